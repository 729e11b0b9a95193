"""Bytes alive after each scheduled instruction, by what they hold: the memory plot's data.

The schedule already carries the timeline of gathered parameter buffers (`gathered_bytes`,
+all_gather, -free). This module adds what else the executor keeps alive, following its rules
(`fxzero/runtime/executor.py`):

- a value is dropped right after its last reader; its storage dies with the last of its
  aliases (views, `getitem`s of a multi-output op, a wait's result, ZeRO-1's reduce-scatter
  into the full gradient buffer);
- a program's outputs stay until the program ends; the backward's saved activations and
  grad_outputs are held by the autograd context for the whole backward;
- unit placeholders (parameter storage) and buffers are model states, counted elsewhere
  (`fxzero.estimate`).

Each storage is classed as `gradients` (it ends as a backward output) or `activations`
(everything else: inputs, saved values, temporaries); gathered buffers are left to the
schedule's own timeline so the two never disagree. The figure for instruction i is the bytes
alive while it runs: its output allocated, its dead inputs not yet dropped.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from fxzero.ir.alias import alias_source
from fxzero.ir.instruction import Instruction
from fxzero.ir.sizes import nbytes
from fxzero.schedule import ProgramSchedule
from fxzero.ir.layout import UnitLayout

__all__ = ["program_live_bytes"]


def _storage_bytes(node: fx.Node, layouts: dict[str, UnitLayout]) -> int:
    """Bytes of the storage a node allocates. Nodes the passes insert carry no fake value;
    their sizes come from their unit's layout."""
    if "val" in node.meta:
        return nbytes(node.meta["val"])
    meta = node.meta.get("fxzero", {})
    layout = layouts.get(meta.get("unit"))
    if layout is None:
        return 0
    if meta.get("kind") in ("flatten_grads", "all_gather"):
        return layout.padded_numel * layout.itemsize
    if meta.get("kind") == "reduce_scatter":
        return layout.shard_numel * layout.itemsize
    return 0


def _storage_parent(node: fx.Node, ins: Instruction | None) -> fx.Node | None:
    """The node whose storage `node` (run as `ins`) shares at run time, if any."""
    if ins is not None and ins.kind == "wait":
        return node.args[0]  # the collective allocated the result; the wait hands it over
    if ins is not None and ins.kind == "reduce_scatter" and ins.keep_full:
        return node.args[0]  # ZeRO-1: the averaged shard is written into the full buffer
    if node.op == "call_function" and node.target is operator.getitem:
        src = node.args[0]
        if isinstance(src, fx.Node) and isinstance(src.meta.get("val"), (tuple, list)):
            return src  # an element of a multi-output op: counted with the op's result
    return alias_source(node)


def program_live_bytes(
    program: ProgramSchedule,
    gm: fx.GraphModule,
    input_kinds: dict[str, str],
    layouts: dict[str, UnitLayout],
    *,
    held: frozenset[str] = frozenset(),
) -> dict[str, list[int]]:
    """Bytes of activations and of gradients alive at each instruction of `program`.

    Args:
        program: the scheduled program (its instruction order is the order executed).
        gm: the program's graph, whose node names the instructions carry.
        input_kinds: placeholder name -> what it is ("unit", "buffer", "input", "saved",
            "grad_output"), from the split pass's `Program.inputs`.
        layouts: unit name -> layout, for the sizes of the nodes the passes inserted.
        held: input kinds alive for the whole program, e.g. {"saved", "grad_output"} for
            the backward (the autograd context holds them), {"input"} for the forward.

    Returns:
        {"activations": [...], "gradients": [...]}, one entry per instruction.
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    n_ins = len(program.instructions)
    last_read: dict[str, int] = {}
    for i, ins in enumerate(program.instructions):
        for r in ins.reads:
            last_read[r] = i

    root_of: dict[str, str] = {}
    by_name = {ins.name: ins for ins in program.instructions}

    def root(name: str) -> str:
        if name not in root_of:
            parent = _storage_parent(nodes[name], by_name.get(name)) if name in nodes else None
            root_of[name] = root(parent.name) if parent is not None else name
        return root_of[name]

    # Lifetimes of storages, by root name: [start, end] in instruction indices (-1: on entry).
    start: dict[str, int] = {}
    end: dict[str, int] = {}
    is_grad: set[str] = set()
    skip: set[str] = set()  # model states and gathered buffers, counted elsewhere
    kept = set(program.kept_names)  # gathered buffers kept from the forward: in the schedule's timeline
    for name, kind in input_kinds.items():
        if kind in ("unit", "buffer") or name in kept:
            skip.add(name)
            continue
        start[name] = -1
        end[name] = n_ins - 1 if kind in held else last_read.get(name, -1)
    outputs = set(program.outputs)
    for i, ins in enumerate(program.instructions):
        r = root(ins.name)
        if r in skip or nodes[r].meta.get("fxzero", {}).get("kind") == "all_gather":
            skip.add(r)
            continue
        start.setdefault(r, i)
        last = n_ins - 1 if ins.name in outputs else last_read.get(ins.name, i)
        end[r] = max(end.get(r, i), i, last)
        if ins.name in outputs and program.name == "backward":
            is_grad.add(r)

    activations = [0] * (n_ins + 1)
    gradients = [0] * (n_ins + 1)
    for r, s in start.items():
        size = _storage_bytes(nodes[r], layouts) if r in nodes else 0
        series = gradients if r in is_grad else activations
        series[max(s, 0)] += size
        series[end[r] + 1] -= size
    out: dict[str, list[int]] = {}
    for key, series in (("activations", activations), ("gradients", gradients)):
        live, values = 0, []
        for i in range(n_ins):
            live += series[i]
            values.append(live)
        out[key] = values
    return out
