"""DeepSpeed's op builders (`deepspeed.ops.op_builder`), which programs ask whether an op runs here.

    from deepspeed.ops.op_builder import CPUAdamBuilder
    if deepspeed.ops.__compatible_ops__[CPUAdamBuilder.NAME]: ...     # (DeepSpeed's own tests)
    CPUAdamBuilder().is_compatible()

Under DeepSpeed a builder compiles (or loads) one C++/CUDA extension, and `__compatible_ops__`
says, by the builder's NAME, which of them this machine can build. fxzero builds no extension:
the classes that stand for DeepSpeed's kernels (`DeepSpeedCPUAdam`, `FusedAdam`, the Adagrad and
Lion ones, `fxzero/runtime/deepspeed_optimizers.py`) are read into fxzero's own update, and its
NVMe tier (`fxzero/runtime/storage/nvme.py`) does the asynchronous I/O that DeepSpeed's "async_io"
op does. So an op is compatible here where fxzero gives what the op is for, on any machine; a
builder's `load()`, which would hand back the extension's raw functions, is an error naming the
fxzero object to use instead. Builders of ops fxzero does not give (inference kernels, sparse
attention, quantizers) are not listed: importing one is an ImportError naming what is.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = ["AsyncIOBuilder", "COMPATIBLE_OPS", "CPUAdagradBuilder", "CPUAdamBuilder", "CPULionBuilder",
           "FusedAdamBuilder", "FusedLionBuilder", "MIN_SWAPPABLE_BYTES", "OpBuilder"]


class OpBuilder:
    """One DeepSpeed op: its NAME, whether it can run here (always, for the ops listed), and what
    stands for it in fxzero."""

    NAME: ClassVar[str]
    USE: ClassVar[str]
    """What a program uses instead of the loaded extension."""

    def is_compatible(self, verbose: bool = False) -> bool:
        return True

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.NAME}.{self.NAME}_op"

    def load(self, verbose: bool = True) -> None:
        raise RuntimeError(f"{type(self).__name__}().load(): fxzero builds no DeepSpeed extension, so there is no "
                           f"{self.NAME!r} op module to call; {self.USE}")


class CPUAdamBuilder(OpBuilder):
    NAME = "cpu_adam"
    USE = "build deepspeed.ops.adam.DeepSpeedCPUAdam and pass it to initialize, or name \"Adam\" in the config"


class FusedAdamBuilder(OpBuilder):
    NAME = "fused_adam"
    USE = "build deepspeed.ops.adam.FusedAdam and pass it to initialize, or name \"Adam\" in the config"


class CPUAdagradBuilder(OpBuilder):
    NAME = "cpu_adagrad"
    USE = "build deepspeed.ops.adagrad.DeepSpeedCPUAdagrad, or name \"Adagrad\" in the config"


class CPULionBuilder(OpBuilder):
    NAME = "cpu_lion"
    USE = "build deepspeed.ops.lion.DeepSpeedCPULion, or name \"Lion\" in the config"


class FusedLionBuilder(OpBuilder):
    NAME = "fused_lion"
    USE = "build deepspeed.ops.lion.FusedLion, or name \"Lion\" in the config"


class AsyncIOBuilder(OpBuilder):
    NAME = "async_io"
    USE = ("the NVMe tier is zero_optimization's offload_param / offload_optimizer with device \"nvme\" "
           "(fxzero.Nvme), which reads and writes on its own thread pool")


COMPATIBLE_OPS: dict[str, bool] = {b.NAME: b().is_compatible() for b in (
    CPUAdamBuilder, FusedAdamBuilder, CPUAdagradBuilder, CPULionBuilder, FusedLionBuilder, AsyncIOBuilder)}
"""`deepspeed.ops.__compatible_ops__`: each listed op's NAME -> whether it can run here."""

MIN_SWAPPABLE_BYTES = 1024 * 1024
"""`deepspeed.runtime.swap_tensor.MIN_SWAPPABLE_BYTES`: DeepSpeed's 1 MiB, below which it keeps a
tensor off NVMe. fxzero's NVMe tier stores each unit's shard whatever its size; the figure is
given for programs (DeepSpeed's tests) that size their tensors by it."""
