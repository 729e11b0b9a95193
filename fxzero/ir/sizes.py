"""Sizes: elements and bytes of traced values, FLOPs of ATen nodes, rounding to a multiple.

A program traced with symbolic sizes ([Note: any size, one program] in `ir/shapes.py`) has
SymInt sizes in its values; every figure here is a number, evaluated at the sizes the trace
registered for its ShapeEnv (`register_sizes`: the example's, data-dependent sizes at their
largest). Evaluating never guards: the program stays valid for every size.
"""

from __future__ import annotations

import weakref
from typing import Any, Mapping

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from fxzero._compat import pytree
from fxzero.ir.rng import replay

__all__ = ["concrete", "flops", "is_fused_attention", "itemsize_of", "nbytes", "register_sizes", "round_up", "value_size"]

_SIZES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
"""ShapeEnv -> {sympy symbol: int}: what its symbols are evaluated at (`register_sizes`)."""


def register_sizes(shape_env: Any, sizes: Mapping[Any, int]) -> None:
    """Evaluate the symbols of `shape_env` at `sizes` from now on (the trace calls this)."""
    _SIZES.setdefault(shape_env, {}).update(sizes)


def concrete(n: Any) -> int:
    """An int size, or a SymInt evaluated at its registered sizes (no guard is added)."""
    if not isinstance(n, torch.SymInt):
        return int(n)
    node = n.node
    known = node.maybe_as_int()
    if known is not None:
        return known
    env = node.shape_env
    expr = env.replace(node.expr)
    value = expr.xreplace(_SIZES.get(env, {})) if hasattr(expr, "xreplace") else expr
    if not getattr(value, "is_number", True):  # a symbol never registered: the ShapeEnv's own hint
        value = env.size_hint(expr)
    return int(value)


def _is_symbolic(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in val.shape)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple


def value_size(val: Any) -> tuple[int, int]:
    """(elements, bytes) of a traced value: a tensor, or a list or tuple of them (else 0, 0)."""
    if isinstance(val, torch.Tensor):
        numel = concrete(val.numel())
        return numel, numel * val.element_size()
    if isinstance(val, (list, tuple)):
        parts = [value_size(v) for v in val]
        return sum(p[0] for p in parts), sum(p[1] for p in parts)
    return 0, 0


def nbytes(val: Any) -> int:
    """Bytes of a traced value (see `value_size`)."""
    return value_size(val)[1]


def itemsize_of(node: Any, default: int) -> int:
    """Bytes per element of a node's traced value (a buffer's dtype), else `default` (e.g. the
    unit layout's: nodes a pass inserted without a traced value)."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.element_size() if isinstance(val, torch.Tensor) else default


def _at_sizes(val: Any) -> Any:
    """A symbolic value as a meta tensor of its evaluated shape, for torch's shape-only formulas."""
    if _is_symbolic(val):
        return torch.empty([concrete(d) for d in val.shape], dtype=val.dtype, device="meta")
    if isinstance(val, torch.SymInt):
        return concrete(val)
    return val


def _cpu_attention(query, key, value, *args, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_attention_backward(grad_out, query, key, value, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


def _grouped_mm(mat_a, mat_b, *args, out_val=None, **kwargs) -> int:
    """torch's grouped matmul (`torch._grouped_mm`, `F.grouped_mm`: a mixture of experts' expert
    projections and their backward), each output element a dot product of the contracted length.
    Both operands 2-D: the groups split the contracted dimension (a weight gradient, out (G, M, N)),
    2 x M x S x N in all; otherwise the contracted length is mat_a's last, shared by every
    group, and 2 x the output's elements x it (rows past the last offset are counted too: an
    upper bound, as the kernel's launch is)."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        return 2 * mat_a.shape[0] * mat_a.shape[1] * mat_b.shape[1]
    return 2 * out_val.numel() * mat_a.shape[-1]


_MORE_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
    **({torch.ops.aten._grouped_mm: _grouped_mm} if hasattr(torch.ops.aten, "_grouped_mm") else {}),
}
"""Operators torch's FLOP registry lacks. Attention on CPU tensors (its CUDA kernels it has):
torch's own SDPA formulas, so a CPU program's attention is priced as the same shapes' GPU one
(issue 26: it was priced at 0 FLOPs, and long sequences were predicted far too fast). The
grouped matmul of a mixture of experts (Hugging Face's default experts in bfloat16): priced at 0
FLOPs before, so a Mixtral's experts cost the simulator nothing."""


_FUSED_ATTENTION = frozenset(getattr(torch.ops.aten, name) for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward", "_efficient_attention_forward")
    if hasattr(torch.ops.aten, name))
"""The forward kernels `scaled_dot_product_attention` dispatches to: each makes the output and a
logsumexp from which its backward recomputes the attention scores."""


def is_fused_attention(node: fx.Node) -> bool:
    """Whether `node` is a fused attention's forward (`_FUSED_ATTENTION`)."""
    return node.op == "call_function" and getattr(node.target, "overloadpacket", None) in _FUSED_ATTENTION


def flops(node: fx.Node) -> int:
    """FLOPs of an ATen node by torch's own formulas (matmuls, convolutions, attention). A random
    operator recomputed in the backward is `replay(state, op, *args)` ([Note: replaying random
    operators] in `fxzero/ir/rng.py`): its FLOPs are `op`'s (a recomputed CUDA attention, which
    counts as random, was priced at 0)."""
    target, node_args = node.target, node.args
    if target is replay:
        target, node_args = node_args[1], node_args[2:]
    packet = getattr(target, "overloadpacket", None)
    formula = flop_registry.get(packet) or _MORE_FLOPS.get(packet)
    if formula is None:
        return 0

    def val(a):
        return _at_sizes(a.meta.get("val")) if isinstance(a, fx.Node) else _at_sizes(a)

    args, kwargs = pytree.tree_map(val, (node_args, node.kwargs))
    try:
        return int(formula(*args, **kwargs, out_val=pytree.tree_map(_at_sizes, node.meta.get("val"))))
    except Exception:  # a formula that cannot read these arguments: count nothing, never fail
        return 0
