"""The device this process trains on, as DeepSpeed's `get_accelerator()` answers for it.

    from fxzero.accelerator import get_accelerator    # DeepSpeed: from deepspeed.accelerator import ...
    get_accelerator().set_device(local_rank)
    device = get_accelerator().device_name(local_rank)    # "cuda:0", or "cpu"

One object per process, for CUDA when torch sees a GPU and for the CPU otherwise (DeepSpeed's
`DS_ACCELERATOR=cpu|cuda` chooses explicitly, as it does there). Everything device-specific
goes through `torch.get_device_module(device_type)`: on the CPU its streams, events and memory
counters are torch's no-op ones, so callers never branch on the device.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch

__all__ = ["TORCH_INFO", "Accelerator", "get_accelerator", "is_current_accelerator_supported", "set_accelerator"]


class Accelerator:
    """DeepSpeed's accelerator interface for one device type ("cuda" or "cpu")."""

    def __init__(self, device_type: str) -> None:
        if device_type not in ("cuda", "cpu"):
            raise ValueError(f"fxzero runs on 'cuda' or 'cpu' devices, got {device_type!r} (DS_ACCELERATOR)")
        self._name = device_type
        self._module = torch.get_device_module(device_type)

    def __repr__(self) -> str:
        return f"fxzero Accelerator({self._name!r})"

    # -- the device -------------------------------------------------------------------------

    def device_name(self, device_index: Optional[int] = None) -> str:
        """"cuda" or "cuda:<index>"; "cpu" whatever the index (CPU ranks share one device)."""
        if device_index is None or self._name == "cpu":
            return self._name
        return f"{self._name}:{device_index}"

    def device(self, device_index: Optional[int] = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    def current_device(self) -> Union[int, torch.device]:
        """CUDA: the current GPU's index. CPU: the CPU device itself, since DeepSpeed's code and
        scripts pass this as `device=` (`torch.tensor(x, device=get_accelerator().current_device())`),
        where an index would name an accelerator this machine does not have."""
        return torch.cuda.current_device() if self._name == "cuda" else torch.device("cpu")

    def current_device_name(self) -> str:
        return self.device_name(self.current_device()) if self._name == "cuda" else "cpu"

    def device_count(self) -> int:
        """CUDA: the GPUs torch sees. CPU: the ranks on this node, as DeepSpeed's CPU accelerator
        counts them (its launcher's LOCAL_SIZE, which harnesses that start ranks themselves set),
        else torchrun's LOCAL_WORLD_SIZE, else 1."""
        if self._name == "cuda":
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or "1")

    def is_available(self) -> bool:
        return self._name == "cpu" or torch.cuda.is_available()

    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def synchronize(self, device_index: Optional[int] = None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # -- what it supports -------------------------------------------------------------------

    def communication_backend_name(self) -> str:
        """The torch.distributed backend fxzero uses on this device: NCCL on CUDA, gloo on the CPU."""
        return "nccl" if self._name == "cuda" else "gloo"

    def is_bf16_supported(self) -> bool:
        return self._name == "cpu" or torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        """Whether float16 is fast here (on the CPU it runs, about 200x slower than bfloat16)."""
        return self._name == "cuda"

    def is_fp64_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        out = [torch.float32, torch.bfloat16] if self.is_bf16_supported() else [torch.float32]
        return out + ([torch.float16] if self.is_fp16_supported() else [])

    # -- random numbers ---------------------------------------------------------------------

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed) if self._name == "cpu" else torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed) if self._name == "cpu" else torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed() if self._name == "cpu" else torch.cuda.initial_seed()

    def get_rng_state(self, device_index: Optional[int] = None) -> torch.Tensor:
        return torch.get_rng_state() if self._name == "cpu" else torch.cuda.get_rng_state(device_index or "cuda")

    def set_rng_state(self, new_state: torch.Tensor, device_index: Optional[int] = None) -> None:
        if self._name == "cpu":
            torch.set_rng_state(new_state)
        else:
            torch.cuda.set_rng_state(new_state, device_index or "cuda")

    def random(self):
        return torch.random

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.default_generator if self._name == "cpu" else torch.cuda.default_generators[device_index]

    # -- streams and events (no-ops on the CPU) -----------------------------------------------

    @property
    def Stream(self):  # noqa: N802 (DeepSpeed's name)
        return self._module.Stream

    @property
    def Event(self):  # noqa: N802
        return self._module.Event

    def stream(self, stream: Any):
        return self._module.stream(stream)

    def current_stream(self, device_index: Optional[int] = None):
        return self._module.current_stream(device_index)

    def default_stream(self, device_index: Optional[int] = None):
        return self._module.default_stream(device_index) if self._name == "cuda" else self._module.current_stream()

    # -- memory -----------------------------------------------------------------------------

    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        """Bytes of tensors on the device now (0 on the CPU: torch does not count host memory;
        `engine.memory_report()` counts fxzero's)."""
        return torch.cuda.memory_allocated(device_index) if self._name == "cuda" else 0

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._name == "cuda" else 0

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        if self._name == "cuda":
            torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._name == "cuda" else 0

    def total_memory(self, device_index: Optional[int] = None) -> int:
        if self._name == "cuda":
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: Optional[int] = None) -> int:
        if self._name == "cuda":
            return torch.cuda.mem_get_info(device_index)[0]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._name == "cuda" else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._name == "cuda" else False

    # -- profiling ranges (no-ops without CUDA) ------------------------------------------------

    def range_push(self, msg: str) -> None:
        if self._name == "cuda":
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._name == "cuda":
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback) -> None:
        callback()

    # -- DeepSpeed's op builders: fxzero has none ---------------------------------------------

    def create_op_builder(self, class_name: str):
        raise NotImplementedError(f"fxzero has no DeepSpeed op builders ({class_name}): its optimizers and "
                                  "collectives are torch's; remove the op-builder call")

    get_op_builder = create_op_builder


_ACCELERATOR: Optional[Accelerator] = None
_SUPPORTED = ("cuda", "cpu")


def _torch_info() -> dict[str, Any]:
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() and torch.version.cuda else None
    return {"version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
            "bf16_support": torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
            "cuda_version": ".".join(torch.version.cuda.split(".")[:2]) if torch.version.cuda else "0.0",
            "nccl_version": ".".join(map(str, nccl[:2])) if nccl else "0.0",
            "hip_version": ".".join(torch.version.hip.split(".")[:2]) if torch.version.hip else "0.0"}


def __getattr__(name: str) -> Any:
    """`TORCH_INFO`: the torch this process runs, as DeepSpeed's `deepspeed.git_version_info.torch_info`
    records the one it was built with (major.minor of torch, CUDA, NCCL, HIP, "0.0" for none, and
    whether CUDA supports bf16); read on first use, since asking CUDA starts its driver."""
    if name == "TORCH_INFO":
        globals()[name] = _torch_info()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_accelerator() -> Accelerator:
    """This process's accelerator: `DS_ACCELERATOR` if set ("cuda" or "cpu"), else CUDA when torch
    sees a GPU, else the CPU."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        name = os.environ.get("DS_ACCELERATOR") or ("cuda" if torch.cuda.is_available() else "cpu")
        _ACCELERATOR = Accelerator(name)
    return _ACCELERATOR


def is_current_accelerator_supported() -> bool:
    """Whether this process's accelerator is one fxzero runs on (CUDA or the CPU: always, once built)."""
    return get_accelerator()._name in _SUPPORTED


def set_accelerator(accelerator: Accelerator) -> None:
    global _ACCELERATOR
    _ACCELERATOR = accelerator
