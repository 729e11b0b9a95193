"""tile: compute an operator too wide to gather whole as tiles of its weight's rows.

A Linear's matmuls (below) and an Embedding's lookups are tiled; a weight tied between the two
(an LM head sharing its embedding's table) is tiled for both.

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

An embedding lookup `e = embedding(w, ids)` becomes, per tile, `embedding(w_i, clamp(ids - a_i))`
selected by `where(a_i <= ids < b_i, ..., previous)`; its gradient `embedding_dense_backward(g,
ids, ...)`, per tile, the same on `g` zeroed where an id is outside the tile (which adds zeros to a
row: no value changes). A tied weight's gradient, the sum of both, is summed per tile in the same
order.

Each operator reading the weight gets its own tile placeholders; partition makes each a view of
its tile's unit, and insert_gather_free gathers a tile once per operator reading it (an ordinary
unit: once per phase) and frees it after: a tied table is gathered tile by tile at the lookup and
again at the head, never held across the forward. The tiles are visible nodes, each with its own
all_gather / wait / free, in `fxzero graph`. The pass runs first, on the traced graph's parameter
placeholders, so every later pass sees tiles as ordinary parameters of ordinary units.

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
bit. Lookups select rows, so an embedding's tiles are exact, forward and backward.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.fx as fx

from fxzero._compat import pytree
from fxzero.ir.layout import ParamSlot
from fxzero.ir.tags import is_kind, output_node
from fxzero.passes.runner import Pass, PassContext, PassResult
from fxzero.passes.tile_plan import TILE_SUFFIX, is_tile, plan_tiles

__all__ = ["PASS", "TILE_SUFFIX", "is_tile", "plan_tiles", "tile_pass"]

REQUIRES: frozenset[str] = frozenset()
PROVIDES = frozenset({"tiled"})

aten = torch.ops.aten
_MATMULS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2)}
"""matmul op -> positions of its (left, right) matrix operands."""


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
    """(operator, operand position, transposed) of every matmul reading the weight through
    transposes, and every embedding looking it up; any other reader is an error naming it."""
    out, stack = [], [(weight, False)]
    while stack:
        node, transposed = stack.pop()
        for user in node.users:
            if user.target is aten.t.default:
                stack.append((user, not transposed))
            elif user.target in _MATMULS and not user.kwargs and user.args.count(node) == 1 \
                    and user.args.index(node) in _MATMULS[user.target]:
                out.append((user, user.args.index(node), transposed))
            elif user.target is aten.embedding.default and user.args[0] is node and not transposed \
                    and not user.kwargs and not any(user.args[3:5]):
                out.append((user, 0, False))
            else:
                raise ValueError(
                    f"Config.tiling: {fqn} is read by {user.target} ({user.name}), which fxzero cannot tile (it "
                    "tiles a Linear's matmuls, transposes of its weight, and an Embedding's lookups without "
                    "scale_grad_by_freq or sparse); drop Config.tiling, or raise Tiling.max_bytes above this "
                    "weight's bytes so it is gathered whole")
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


def _local(b: _Builder, ids: fx.Node, rows: tuple[int, int]) -> tuple[fx.Node, fx.Node]:
    """Which ids fall in the tile's rows, and each id as a row of the tile (clamped into it)."""
    a, c = rows
    inside = b(aten.logical_and.default, b(aten.ge.Scalar, ids, a), b(aten.lt.Scalar, ids, c))
    return b(aten.unsqueeze.default, inside, -1), b(aten.clamp.default, b(aten.sub.Scalar, ids, a), 0, c - a - 1)


def _tile_embedding(graph: fx.Graph, emb: fx.Node, pieces: list[fx.Node], rows: list[tuple[int, int]]) -> None:
    """Replace a lookup in the weight by one lookup per tile, each row taken from the tile that
    holds it (a selection: equal bit for bit)."""
    b = _Builder(graph, emb, emb)
    ids = emb.args[1]
    out: Optional[fx.Node] = None
    for piece, r in zip(pieces, rows):
        inside, local = _local(b, ids, r)
        found = b(aten.embedding.default, piece, local)
        out = b(aten.where.ScalarOther, inside, found, 0.0) if out is None else b(aten.where.self, inside, found, out)
    emb.replace_all_uses_with(out)
    graph.erase_node(emb)


def _grad_tiles(b: _Builder, node: fx.Node, fqn: str, rows: list[tuple[int, int]]) -> list[fx.Node]:
    """A gradient of the weight (g^T @ x under transposes, an embedding's backward, or a tied
    weight's sum of those) as one gradient per tile of rows."""
    transposed = False
    while node.target is aten.t.default:
        node, transposed = node.args[0], not transposed
    if node.target is aten.add.Tensor and not node.kwargs and not transposed:  # a tied weight's: per tile, in order
        x, y = (_grad_tiles(b, arg, fqn, rows) for arg in node.args)
        return [b(aten.add.Tensor, p, q) for p, q in zip(x, y)]
    if node.target is aten.embedding_dense_backward.default and not transposed and not node.args[4]:
        g, ids, _, pad, _ = node.args
        out = []
        for a, c in rows:  # ids outside the tile add zeros to a row of it: no value changes
            inside, local = _local(b, ids, (a, c))
            out.append(b(aten.embedding_dense_backward.default, b(aten.where.ScalarOther, inside, g, 0.0), local,
                         c - a, pad - a if a <= pad < c else -1, False))
        return out
    if node.target is not aten.mm.default:
        raise ValueError(f"Config.tiling: the gradient of {fqn} is computed by {node.target} ({node.name}), which "
                         "fxzero cannot tile; drop Config.tiling, or raise Tiling.max_bytes above this weight's bytes")
    a, c = node.args
    if transposed:  # grad = t(a @ c): its rows are c's columns
        return [b(aten.t.default, b(aten.mm.default, a, _slice(b, c, 1, r))) for r in rows]
    return [b(aten.mm.default, _slice(b, a, 0, r), c) for r in rows]


def _piece_placeholders(graph: fx.Graph, weight: fx.Node, slots: list[ParamSlot], op: fx.Node) -> list[fx.Node]:
    val = weight.meta.get("val")
    pieces = []
    with graph.inserting_after(weight):
        for s in reversed(slots):
            p = graph.placeholder(f"{weight.name}_{op.name}_rows_{s.start // math.prod(s.shape[1:])}")
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
    grads = dict(zip(sig.trainable_fqns, range(sig.num_outputs, sig.num_outputs + len(sig.trainable_fqns))))
    weights = {n.meta["fxzero"]["fqn"]: n for n in graph.nodes if n.op == "placeholder" and is_kind(n, "param")}
    count = 0
    for fqn, slots in tiles.items():
        slots.sort(key=lambda s: s.start)
        cols = math.prod(slots[0].shape[1:])
        rows = [(s.start // cols, s.start // cols + s.shape[0]) for s in slots]
        weight = weights[fqn]
        uses = _uses(weight, fqn)
        for op, position, transposed in uses:
            pieces = _piece_placeholders(graph, weight, slots, op)  # (per operator: each gathers its tiles)
            if op.target is aten.embedding.default:
                _tile_embedding(graph, op, pieces, rows)
            else:
                _tile_matmul(graph, op, position, transposed, pieces, rows)
        count += len(uses) * len(slots)
        results = list(out.args[0])  # (read after the tiling: a tiled operator may be an output itself)
        if fqn in grads and isinstance(results[grads[fqn]], fx.Node):
            grad = results[grads[fqn]]
            tile_grads = _grad_tiles(_Builder(graph, grad.next, grad), grad, fqn, rows)
            results[grads[fqn]] = tile_grads  # (a list: kept alive until insert_reduce_scatter reads it)
            for s, g in zip(slots, tile_grads):
                ctx.outputs.setdefault("tile_grads", {})[(fqn, s.start)] = g
            count += len(tile_grads)
        out.args = (results,)
    graph.eliminate_dead_code()
    for fqn in tiles:
        if not weights[fqn].users:
            graph.erase_node(weights[fqn])
    return PassResult(gm, changed=True, summary={"tiled_parameters": len(tiles), "tile_operators": count,
                                                 "tiles": sum(len(s) for s in tiles.values())})


PASS = Pass("tile", tile_pass, requires=REQUIRES, provides=PROVIDES)
