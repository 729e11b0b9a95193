"""tile: compute an operator too wide to gather whole as tiles of its weight's rows.

Before (`head.weight`, out x in, one parameter of unit `root:tail`)::

    w = placeholder[param head.weight]
    y = addmm(b, x, t(w))                      # forward: x @ w^T + b
    gx = mm(g, t(t(w)))                        # backward: the input's gradient, g @ w
    gw = t(t(mm(t(g), x)))                     # backward: the weight's gradient, g^T @ x
    return [..., gw, ...]

After (tiles of rows [0, r), [r, 2r), ...; each its own unit `head.weight:tile<i>`)::

    w0 = placeholder[param head.weight rows 0:r]   w1 = placeholder[param head.weight rows r:2r]
    y0 = addmm(b[0:r], x, t(w0));  y1 = addmm(b[r:2r], x, t(w1));  y = cat([y0, y1], 1)
    gx0 = mm(g[:, 0:r], w0);       gx = addmm(gx0, g[:, r:2r], w1)
    gw0 = mm(t(g)[0:r], x);        gw1 = mm(t(g)[r:2r], x)
    return [..., [gw0, gw1], ...]                  # one gradient per tile, in row order

Partition then makes each tile a view of its own unit's buffer, and insert_gather_free gathers
each tile before its use and frees it after, per phase: the tiles are visible nodes, each with
its own all_gather / wait / free, in `fxzero graph`. The pass runs first, on the traced graph's
parameter placeholders, so every later pass sees tiles as ordinary parameters of ordinary units.

[Note: tiling]
Sharding. A tile must be gathered on its own, moving only its bytes, so it is sharded on its
own: `plan_tiles` takes a tiled weight out of its unit and gives each tile of rows a unit of its
own (`head.weight:tile0`, ...), one flat buffer padded to the world size, like any unit. Rows
of a row-major weight are a contiguous range of its elements, so a tile is described by the
existing `ParamSlot` plus where it starts in the parameter (`start`) and the parameter's shape
(`param_shape`): the slot's `fqn` stays the parameter's. Everything the user sees (state dicts,
checkpoints, export, the module after training, optimizer state) is keyed by `fqn` and reads
each tile's elements into [start, start + numel) of the whole parameter, so the parameter keeps
its name and full shape; only the compiler and the collectives see tiles. The weight's other
parameters (its bias) stay in their unit, which is gathered while the tiles compute.

Bound. A tile holds at most `Tiling.max_bytes // 2` bytes of weight, so the tile computing plus
the one prefetched stay within `max_bytes`; `build_pipeline` caps the prefetch budget (where the
user set none) at `max_bytes` plus the largest other unit, so prefetch and keep-for-backward
cannot hold more tiles than that.

Numerics. Tiles split the output features (the weight's rows), never the reduction dimension,
so each forward output element and each row of the weight's gradient is the same dot product
over the same elements as untiled, computed by the same kernel on a slice: equal bit for bit on
the kernels we ran (checked in tests/compile/test_tiling.py; BLAS may block a reduction
differently for a narrower matrix, which is why the parity tests allow 1e-6). The input's
gradient, g @ w, reduces over the output features, which the tiles split: it is the sum over
tiles of g[:, rows] @ w[rows], accumulated in tile order (addmm), so its additions happen in
another order than one GEMM's: equal within float rounding (1e-6 relative in fp32), not bit for
bit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.fx as fx
import torch.nn as nn

from fxzero._compat import pytree
from fxzero.config import Tiling
from fxzero.config.notices import warn_ineffective
from fxzero.ir.layout import ParamSlot, UnitLayout, unique_parameters
from fxzero.ir.tags import is_kind, output_node
from fxzero.passes.runner import Pass, PassContext, PassResult

__all__ = ["PASS", "TILE_SUFFIX", "is_tile", "plan_tiles", "tile_pass"]

REQUIRES: frozenset[str] = frozenset()
PROVIDES = frozenset({"tiled"})

TILE_SUFFIX = ":tile"
"""Tile units are named `<parameter FQN>:tile<i>`."""

aten = torch.ops.aten
_MATMULS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2)}
"""matmul op -> positions of its (left, right) matrix operands."""


def is_tile(layout: UnitLayout) -> bool:
    """Whether a unit holds one tile of a tiled parameter."""
    return any(s.param_shape is not None for s in layout.slots)


# -- plan: which weights are tiled, and their units ------------------------------------------------

def _tiled_linears(model: nn.Module, layouts: list[UnitLayout], tiling: Tiling, itemsize: Optional[int]):
    """(module FQN, module, weight slot's unit, slot) of each Linear whose weight is over the bound."""
    where = {s.fqn: (lay, s) for lay in layouts for s in lay.slots}
    largest, out = ("", 0), []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        fqn = f"{name}.weight" if name else "weight"
        nbytes = module.weight.numel() * (itemsize or module.weight.dtype.itemsize)
        largest = max(largest, (fqn, nbytes), key=lambda x: x[1])
        if nbytes <= tiling.max_bytes:
            continue
        if fqn not in where:  # tied: its unique name is another module's (an LM head tied to its embedding)
            warn_ineffective([f"Tiling(max_bytes={tiling.max_bytes}): {name} ({nbytes} bytes of weight) is not "
                              "tiled: its weight is tied to another module's, which uses it in other operators "
                              "(an embedding); untie it to tile it"])
            continue
        out.append((name, module, *where[fqn]))
    return out, largest


def _rows(name: str, module: nn.Linear, tiling: Tiling, itemsize: Optional[int]) -> list[tuple[int, int]]:
    rows, cols = module.weight.shape
    row_bytes = cols * (itemsize or module.weight.dtype.itemsize)
    if row_bytes > tiling.tile_bytes:
        raise ValueError(
            f"Tiling(max_bytes={tiling.max_bytes}): operator {name or 'the model'} (Linear {cols} -> {rows}) "
            f"has rows of {row_bytes} bytes, and a tile is at least one row and at most max_bytes // 2 = "
            f"{tiling.tile_bytes} bytes (the tile computing and the one prefetched share max_bytes): "
            f"set Tiling(max_bytes={2 * row_bytes}) or more")
    per = tiling.tile_bytes // row_bytes
    count = math.ceil(rows / per)
    per = math.ceil(rows / count)  # (even tiles: the same count, the last not left small)
    return [(a, min(a + per, rows)) for a in range(0, rows, per)]


def plan_tiles(model: nn.Module, layouts: list[UnitLayout], tiling: Optional[Tiling], *, stage: int,
               itemsize: Optional[int]) -> list[UnitLayout]:
    """The layouts with each tiled weight taken out of its unit and split into tile units of its
    rows, placed right after that unit ([Note: tiling]).

    Args:
        itemsize: bytes per element of what the forward gathers (mixed precision's compute dtype);
            None: the model's own dtype.

    Raises:
        ValueError: if a weight's row alone is more than a tile may hold.
    """
    if tiling is None:
        return layouts
    if stage != 3:
        warn_ineffective([f"Config.tiling has no effect at stage {stage}: every rank holds whole parameters, "
                          "nothing is gathered per operator; use stage=3"])
        return layouts
    found, (largest, largest_bytes) = _tiled_linears(model, layouts, tiling, itemsize)
    if not found:
        warn_ineffective([f"Tiling(max_bytes={tiling.max_bytes}) has no effect: no Linear's gathered weight is "
                          f"larger (the largest: {largest or 'none'}, {largest_bytes} bytes); lower max_bytes or "
                          "drop Config.tiling"])
        return layouts
    tiles_of = {slot.fqn: (name, module, slot) for name, module, _, slot in found}
    out: list[UnitLayout] = []
    for layout in layouts:
        kept = [s for s in layout.slots if s.fqn not in tiles_of]
        if kept:
            slots, offset = [], 0
            for s in kept:
                slots.append(dataclasses.replace(s, offset=offset))
                offset += s.numel
            out.append(dataclasses.replace(layout, slots=tuple(slots)))
        for s in layout.slots:
            if s.fqn not in tiles_of:
                continue
            name, module, _ = tiles_of[s.fqn]
            cols = math.prod(s.shape[1:])
            for i, (a, b) in enumerate(_rows(name, module, tiling, itemsize)):
                piece = ParamSlot(s.fqn, (b - a, *s.shape[1:]), 0, (b - a) * cols, start=a * cols, param_shape=s.shape)
                out.append(UnitLayout(f"{s.fqn}{TILE_SUFFIX}{i}", (piece,), layout.dtype, layout.world_size,
                                      layout.trainable))
    return out


# -- apply: rewrite the operators ------------------------------------------------------------------

class _Builder:
    """Adds nodes before `anchor`, each with the metadata of `like` and a fake value."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node, like: fx.Node) -> None:
        self.graph, self.anchor, self.like = graph, anchor, like

    def __call__(self, target, *args) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args)
        node.meta.update({k: v for k, v in self.like.meta.items() if k not in ("val", "fxzero")})
        if "fxzero" in self.like.meta:
            node.meta["fxzero"] = dict(self.like.meta["fxzero"])
        vals = fx.node.map_arg(args, lambda n: n.meta.get("val"))
        leaves = [v for v in pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)]
        if leaves and all(v is not None for v in pytree.tree_leaves(vals)):
            with leaves[0].fake_mode:
                node.meta["val"] = target(*vals)
        return node


def _uses(weight: fx.Node, fqn: str) -> list[tuple[fx.Node, int, bool]]:
    """(matmul, operand position, transposed) of every matmul reading the weight through
    transposes; any other reader is an error naming it."""
    out, stack = [], [(weight, False)]
    while stack:
        node, transposed = stack.pop()
        for user in node.users:
            if user.target is aten.t.default:
                stack.append((user, not transposed))
            elif user.target in _MATMULS and not user.kwargs and user.args.count(node) == 1 \
                    and user.args.index(node) in _MATMULS[user.target]:
                out.append((user, user.args.index(node), transposed))
            else:
                raise ValueError(
                    f"Config.tiling: {fqn} is read by {user.target} ({user.name}), which fxzero cannot tile (it "
                    "tiles a Linear's matmuls: mm, addmm and transposes of the weight); drop Config.tiling, or "
                    "raise Tiling.max_bytes above this weight's bytes so it is gathered whole")
    return out


def _slice(b: _Builder, x: fx.Node, dim: int, rows: tuple[int, int]) -> fx.Node:
    return b(aten.slice.Tensor, x, dim, rows[0], rows[1])


def _tile_matmul(graph: fx.Graph, mm: fx.Node, position: int, transposed: bool, pieces: list[fx.Node],
                 rows: list[tuple[int, int]]) -> None:
    """Replace one matmul reading the weight W (out x in) by one matmul per tile of W's rows.

    W's rows are the result's columns (x @ W^T) or rows (W @ y): the tiles' results are
    concatenated; or they are the reduction dimension (x @ W, W^T @ y): the tiles' products are
    summed, in tile order.
    """
    b = _Builder(graph, mm, mm)
    left, right = _MATMULS[mm.target]
    bias = mm.args[0] if mm.target is aten.addmm.default else None
    other = mm.args[right if position == left else left]
    on_left = position == left
    concat = transposed != on_left  # W's rows index the result's columns (right, W^T) or rows (left, W)
    parts: list[fx.Node] = []
    acc: Optional[fx.Node] = None
    for piece, r in zip(pieces, rows):
        w = b(aten.t.default, piece) if transposed else piece
        if concat:
            dim = 0 if on_left else 1
            x = other
            tile_bias = bias
            if bias is not None:  # a bias broadcast along W's rows is sliced with them
                shape = bias.meta["val"].shape
                k = dim - (2 - len(shape))
                if k >= 0 and shape[k] != 1:
                    tile_bias = _slice(b, bias, k, r)
            args = (x, w) if not on_left else (w, x)
            parts.append(b(aten.addmm.default, tile_bias, *args) if bias is not None else b(aten.mm.default, *args))
        else:
            x = _slice(b, other, 0 if on_left else 1, r)  # W^T @ y: y's rows; x @ W: x's columns
            args = (w, x) if on_left else (x, w)
            start = acc if acc is not None else bias
            acc = b(aten.addmm.default, start, *args) if start is not None else b(aten.mm.default, *args)
    result = b(aten.cat.default, parts, 0 if on_left else 1) if concat else acc
    mm.replace_all_uses_with(result)
    graph.erase_node(mm)


def _tile_gradient(graph: fx.Graph, grad: fx.Node, fqn: str, rows: list[tuple[int, int]]) -> list[fx.Node]:
    """The weight's gradient (g^T @ x under transposes) as one gradient per tile of rows."""
    node, transposed = grad, False
    while node.target is aten.t.default:
        node, transposed = node.args[0], not transposed
    if node.target is not aten.mm.default:
        raise ValueError(f"Config.tiling: the gradient of {fqn} is computed by {node.target} ({node.name}), not "
                         "one matmul, so fxzero cannot tile it; drop Config.tiling, or raise Tiling.max_bytes "
                         "above this weight's bytes")
    a, c = node.args
    b = _Builder(graph, grad.next, node)
    out = []
    for r in rows:
        if transposed:  # grad = t(a @ c): its rows are c's columns
            out.append(b(aten.t.default, b(aten.mm.default, a, _slice(b, c, 1, r))))
        else:
            out.append(b(aten.mm.default, _slice(b, a, 0, r), c))
    return out


def _piece_placeholders(graph: fx.Graph, weight: fx.Node, slots: list[ParamSlot]) -> list[fx.Node]:
    val = weight.meta.get("val")
    pieces = []
    with graph.inserting_after(weight):
        for s in reversed(slots):
            p = graph.placeholder(f"{weight.name}_rows_{s.start // math.prod(s.shape[1:])}")
            p.meta["fxzero"] = {**weight.meta["fxzero"], "start": s.start}
            if val is not None:
                with val.fake_mode:
                    p.meta["val"] = torch.empty(s.shape, dtype=val.dtype, device=val.device)
            pieces.insert(0, p)
    return pieces


def tile_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    graph = gm.graph
    tiles: dict[str, list[ParamSlot]] = {}
    for layout in ctx.layouts:
        for s in layout.slots:
            if s.param_shape is not None:
                tiles.setdefault(s.fqn, []).append(s)
    if not tiles:
        return PassResult(gm, changed=False)
    sig = ctx.signature
    out = output_node(graph)
    results = list(out.args[0])
    grads = dict(zip(sig.trainable_fqns, range(sig.num_outputs, sig.num_outputs + len(sig.trainable_fqns))))
    weights = {n.meta["fxzero"]["fqn"]: n for n in graph.nodes if n.op == "placeholder" and is_kind(n, "param")}
    count = 0
    for fqn, slots in tiles.items():
        slots.sort(key=lambda s: s.start)
        cols = math.prod(slots[0].shape[1:])
        rows = [(s.start // cols, s.start // cols + s.shape[0]) for s in slots]
        weight = weights[fqn]
        uses = _uses(weight, fqn)
        pieces = _piece_placeholders(graph, weight, slots)
        for mm, position, transposed in uses:
            _tile_matmul(graph, mm, position, transposed, pieces, rows)
        count += len(uses) * len(slots)
        if fqn in grads and isinstance(results[grads[fqn]], fx.Node):
            tile_grads = _tile_gradient(graph, results[grads[fqn]], fqn, rows)
            results[grads[fqn]] = tile_grads  # (a list: kept alive until insert_reduce_scatter reads it)
            for s, g in zip(slots, tile_grads):
                ctx.outputs.setdefault("tile_grads", {})[(fqn, s.start)] = g
            count += len(tile_grads)
    out.args = (results,)
    graph.eliminate_dead_code()
    for fqn in tiles:
        if not weights[fqn].users:
            graph.erase_node(weights[fqn])
    return PassResult(gm, changed=True, summary={"tiled_parameters": len(tiles), "tile_matmuls": count,
                                                 "tiles": sum(len(s) for s in tiles.values())})


PASS = Pass("tile", tile_pass, requires=REQUIRES, provides=PROVIDES)
