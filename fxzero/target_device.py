"""Tracing for the device a program runs on: the kernels that device runs, and its allocations.

[Note: tracing for a device]
A program holds ATen operators, and some choices between them are made by the device while
tracing: `F.scaled_dot_product_attention` lowers on a CPU tensor to
`_scaled_dot_product_flash_attention_for_cpu`, a kernel CUDA does not have, and on a CUDA tensor
to the flash or memory-efficient CUDA kernel. So a program for a GPU must be traced for the GPU.

The obvious way, fake tensors on `cuda`, works only on a CUDA build of torch: autograd asks the
device's guard for a stream when it records a CUDA tensor, and a CPU build has no CUDA guard
(c10's `ensureCUDADeviceGuardSet` installs its no-op guard only where a CUDA build finds no GPU).
fxzero compiles GPU programs on CPU machines (CI, the CLI, `tools/gpu_check.py --dry-run`), and
it must compile the same program on both, so it traces every program on fake CPU tensors and
makes the device's choices itself:

- Attention: `TargetKernels` intercepts `F.scaled_dot_product_attention` during the trace and
  calls the kernel that device would pick (`sdpa_backend`, torch's own eligibility rules for
  flash and memory-efficient attention, honouring `torch.backends.cuda.*_sdp_enabled()`): its
  ATen operator and its backward (torch's derivative formula) are then in the program, with
  their fake kernels sizing every buffer.
- Allocations: `retarget` rewrites the `device=` of every operator that creates a tensor
  (`full`, `arange`, `empty`, `scalar_tensor`, ...) to the target device.
- A kernel only the CPU has that still reaches a GPU program is an error naming it
  (`check_no_cpu_kernels`), never a program that fails on the GPU.

Kernels also take some operands only in some dtype combinations: a batch norm with bf16
parameters beside fp32 running statistics (mixed precision) runs in fp32 as a whole, on every
device ([Note: batch norm under mixed precision]).

What this does not change: the `val` metadata of the graph's nodes stays fake CPU tensors (the
passes read their sizes and dtypes only); `Schedule.device` says which device the program is for.
A model's own `torch.autocast("cuda")` region is traced under CPU autocast with its dtype (the same
matmuls, convolutions and attention cast; a few other ops' lists differ), said once; on a machine
without CUDA torch itself disables a CUDA autocast region, and says so.
"""

from __future__ import annotations

import inspect
import math
import warnings
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["TargetKernels", "check_no_cpu_kernels", "cpu_only_kernels", "retarget", "sdpa_backend", "target_device"]


def target_device(device) -> torch.device:
    """The device type a program is for, without an index (a rank's own index comes at run time).

    "meta" stands for an accelerator whose tensors hold no values: fxzero's tests run a whole
    step on it to find any buffer left in host memory and any host sync (a meta tensor has no
    value to read), on a machine without a GPU."""
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda", "meta"):
        raise ValueError(f"fxzero compiles programs for 'cpu', 'cuda' or 'meta', not {kind!r}")
    return torch.device(kind)


def _flash_eligible(q, k, v, attn_mask, head_dim: int) -> bool:
    return (torch.backends.cuda.flash_sdp_enabled() and attn_mask is None
            and q.dtype in (torch.float16, torch.bfloat16) and q.dim() == 4
            and k.size(-1) == head_dim and v.size(-1) == head_dim
            and head_dim % 8 == 0 and head_dim <= 256)


def _efficient_eligible(q, k, v, head_dim: int) -> bool:
    alignment = 16 // q.element_size()  # 16-byte aligned rows: 4 fp32, 8 fp16/bf16 elements
    return (torch.backends.cuda.mem_efficient_sdp_enabled() and q.dim() == 4
            and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and k.size(-1) == head_dim and head_dim % alignment == 0 and v.size(-1) % alignment == 0)


def sdpa_backend(q, k, v, attn_mask=None) -> str:
    """The CUDA kernel torch's SDPA dispatcher picks for these inputs on a GPU of compute
    capability 8.0 or later (A100, H100, H200, B200): "flash", "efficient" or "math".

    torch's order there is flash, then memory-efficient, then math (cuDNN attention is tried
    after them since torch 2.5.1); each with the rules of `sdp_utils.cpp`, reduced to what a
    fake tensor can tell: flash wants fp16/bf16, no mask, equal head dims, a multiple of 8 up to
    256; memory-efficient takes fp32 too and a mask, with rows aligned to 16 bytes.
    """
    head_dim = q.size(-1)
    if not (q.dtype == k.dtype == v.dtype):
        return "math"  # (which raises torch's own error for mixed dtypes, as every CUDA kernel would)
    if _flash_eligible(q, k, v, attn_mask, head_dim):
        return "flash"
    if _efficient_eligible(q, k, v, head_dim):
        return "efficient"
    return "math"


def _repeat_kv(q, k, v):
    """Grouped-query attention as SDPA's math path computes it: each key/value head repeated
    for its group of query heads."""
    groups = q.size(-3) // k.size(-3)
    return k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)


def _additive_bias(attn_mask, q, k):
    """The mask as the additive float bias the memory-efficient kernel takes: a boolean mask's
    False is -inf, as SDPA's `convert_boolean_attn_mask`; the last dim padded to a multiple of 16
    elements and sliced back, as SDPA's `preprocess_mask`, so its rows are aligned for the kernel."""
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros((), dtype=q.dtype).masked_fill(attn_mask.logical_not(), float("-inf"))
    attn_mask = attn_mask.to(q.dtype).expand(q.size(0), q.size(1), q.size(2), k.size(2))
    length = k.size(2)
    padded = math.ceil(length / 16) * 16
    if padded != length:
        attn_mask = F.pad(attn_mask, (0, padded - length))[..., :length]
    return attn_mask


def _sdpa_for_cuda(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
    if enable_gqa and key.size(-3) != query.size(-3):
        key, value = _repeat_kv(query, key, value)
    backend = "math" if (attn_mask is not None and is_causal) else sdpa_backend(query, key, value, attn_mask)
    if backend == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                                  scale=scale)[0]
    if backend == "efficient":
        bias = _additive_bias(attn_mask, query, key) if attn_mask is not None else None
        return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, True, dropout_p,
                                                                      is_causal, scale=scale)[0]
    return torch.ops.aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal,
                                                             scale=scale)[0]


_BATCH_NORM = inspect.signature(F.batch_norm)


def _mixed_batch_norm(args: tuple, kwargs: dict) -> bool:
    """Whether `F.batch_norm`'s input, weight or bias is in another dtype than its floating
    running statistics ([Note: batch norm under mixed precision])."""
    a = _BATCH_NORM.bind(*args, **kwargs).arguments
    stats = a.get("running_mean")
    return stats is not None and stats.is_floating_point() and any(
        t is not None and t.dtype != stats.dtype for t in (a["input"], a.get("weight"), a.get("bias")))


def _batch_norm_in_stats_dtype(args: tuple, kwargs: dict) -> torch.Tensor:
    """`F.batch_norm`, computed in its running statistics' dtype where the input's or the weight's
    differs, its output in the input's dtype.

    [Note: batch norm under mixed precision]
    Mixed precision casts a model's parameters to the compute dtype and keeps its buffers in their
    own (fp32 running statistics, as FSDP's policies do). Neither the CPU's nor CUDA's batch-norm
    kernels take a bf16 or fp16 weight beside fp32 statistics ("expected scalar type BFloat16 but
    found Float"), and the traced forward (a decomposition, for its statistics' update) hands the
    backward kernel statistics in the input's dtype, which its mixed-dtype form refuses. So such a
    norm runs in fp32 as a whole, as autocast runs it: the input and the weight cast up (exactly),
    the statistics updated in fp32, the output rounded once to the input's dtype (what the
    kernels' own mixed-dtype forward computes), and the gradients flowing back through the casts
    into each one's own dtype. A norm whose dtypes already agree is traced as it is
    (`_mixed_batch_norm`)."""
    bound = _BATCH_NORM.bind(*args, **kwargs)
    a = bound.arguments
    stats, out_dtype = a["running_mean"], a["input"].dtype
    for name in ("input", "weight", "bias"):
        if a.get(name) is not None and a[name].is_floating_point():
            a[name] = a[name].to(stats.dtype)
    return F.batch_norm(*bound.args, **bound.kwargs).to(out_dtype)


_AUTOCAST_NOTED = False


class TargetKernels(TorchFunctionMode):
    """During a trace for `device`, the calls whose kernel the device chooses are made as that
    device would make them ([Note: tracing for a device]); on CPU that changes nothing. On every
    device, a batch norm whose parameters' dtype is not its statistics' runs in the statistics'
    dtype ([Note: batch norm under mixed precision])."""

    def __init__(self, device) -> None:
        super().__init__()
        self.device = target_device(device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.batch_norm and _mixed_batch_norm(args, kwargs):
            return _batch_norm_in_stats_dtype(args, kwargs)
        if self.device.type == "cpu":
            return func(*args, **kwargs)
        if torch.is_autocast_enabled("cuda"):  # the model's torch.autocast("cuda") region, on CPU tensors
            _note_autocast()
            with torch.autocast("cpu", dtype=torch.get_autocast_dtype("cuda")):
                return self._call(func, args, kwargs)
        return self._call(func, args, kwargs)

    @staticmethod
    def _call(func, args, kwargs):
        if func is F.scaled_dot_product_attention:
            return _sdpa_for_cuda(*args, **kwargs)
        return func(*args, **kwargs)


def _note_autocast() -> None:
    global _AUTOCAST_NOTED
    if not _AUTOCAST_NOTED:
        _AUTOCAST_NOTED = True
        warnings.warn("the model enters torch.autocast(\"cuda\"): fxzero traces a GPU program on CPU tensors, so "
                      "that region is traced under CPU autocast with the same dtype, whose op lists cast the same "
                      "matmuls, convolutions and attention to it but keep a few other ops in another dtype than "
                      "CUDA's; fxzero's own mixed precision (Config.mixed_precision) is exact on both",
                      stacklevel=3)


def retarget(gm: fx.GraphModule, device) -> int:
    """Rewrite the `device=` of every node that creates a tensor to `device`; returns how many.

    The trace ran on CPU tensors, so every tensor the forward made itself (positions, masks,
    constants) was made on the CPU; on the target device it is made there, as the model's own
    `device=x.device` would under a GPU run.
    """
    device = target_device(device)
    if device.type == "cpu":
        return 0
    changed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.kwargs.get("device"), torch.device) \
                and node.kwargs["device"].type == "cpu":
            node.kwargs = {**node.kwargs, "device": device}
            changed += 1
    if changed:
        gm.recompile()
    return changed


def cpu_only_kernels(gm: fx.GraphModule) -> list[str]:
    """The operators of `gm` that only a CPU runs (`*_for_cpu`, oneDNN/MKL-DNN kernels)."""
    found = []
    for node in gm.graph.nodes:
        name = str(node.target) if node.op == "call_function" else ""
        if name.startswith("aten.") and ("_for_cpu" in name or "mkldnn" in name or "onednn" in name):
            found.append(name)
    return sorted(set(found))


def check_no_cpu_kernels(gm: fx.GraphModule, device) -> None:
    """Raise ValueError if a program for a GPU holds a kernel only the CPU has."""
    if target_device(device).type == "cpu":
        return
    found = cpu_only_kernels(gm)
    if found:
        raise ValueError(
            f"the program for {target_device(device).type} holds kernels only the CPU runs: {', '.join(found)}; "
            "fxzero traces GPU programs on CPU tensors and chooses the GPU's kernel where the device decides "
            "(fxzero/target_device.py): this operator has no such choice yet, please report it with the model"
        )
