"""insert_gather_free: all-gather a sharded unit before its first use in each phase, free after its last.

Before (unit_0 sharded, used by forward nodes a..b and backward nodes c..d)::

    a = f(as_strided(unit_0, ...))   ...   b = g(view(unit_0))      # forward
    c = h(as_strided_1(unit_0, ...)) ...   d = k(unit_0)            # backward

After::

    ag = fxzero.all_gather(unit_0, "u0", world)     # forward
    w = fxzero.wait(ag)
    a = f(as_strided(w, ...)) ... b = g(view(w))
    fxzero.free(w)                                  # after the last use of w or any view of it
    ag_1 = fxzero.all_gather(unit_0, "u0", world)   # backward: again, from the shard
    w_1 = fxzero.wait(ag_1)
    c = h(as_strided_1(w_1, ...)) ... d = k(w_1)
    fxzero.free(w_1)

After this pass a unit placeholder of a sharded unit holds the rank's shard only. Unsharded
units (ZeRO-1/2) are left as they are: their buffer is persistent for the whole step.
"""

from __future__ import annotations


import torch
import torch.fx as fx

from fxzero.ir.ops import OPS
from fxzero.ir.alias import alias_closure
from fxzero.ir.tags import BACKWARD, FORWARD, is_kind, last_user, phase, positions, tag
from fxzero.passes.runner import Pass, PassContext, PassResult
from fxzero.passes.tile_plan import is_tile

REQUIRES = frozenset({"units_partitioned", "phases"})
PROVIDES = frozenset({"params_gathered"})


def _is_sharded_unit(node: fx.Node) -> bool:
    return node.op == "placeholder" and is_kind(node, "unit") and node.meta["fxzero"]["sharded"]


def _users_in(node: fx.Node, which: str) -> list[fx.Node]:
    return [u for u in node.users if phase(u) == which]


def _gather_before(graph: fx.Graph, unit_node: fx.Node, first: fx.Node, which: str, world: int):
    unit = unit_node.meta["fxzero"]["unit"]
    with graph.inserting_before(first):
        start = graph.call_function(OPS["all_gather"], (unit_node, unit, world))
        done = graph.call_function(OPS["wait"], (start,))
    tag(start, kind="all_gather", unit=unit, phase=which)
    tag(done, kind="wait", unit=unit, phase=which, waits_for=start.name)
    full = unit_node.meta.get("val")  # the unit's whole flat buffer, in the dtype it computes in
    if full is not None:
        start.meta["val"] = done.meta["val"] = full
    return start, done


def _use_groups(unit_node: fx.Node, which: str, layout) -> list[list[fx.Node]]:
    """The unit's readers in phase `which`, grouped by gather: all of them, but a tile is gathered
    once per operator reading it ([Note: tiling] in `passes/tile.py`: a tied embedding and LM head
    gather each tile at the lookup and again at the head, not across the whole forward)."""
    users = _users_in(unit_node, which)
    if not is_tile(layout):
        return [users]
    pos = positions(unit_node.graph)
    return [[u] for u in sorted(users, key=pos.__getitem__)]


def insert_gather_free_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    graph = gm.graph
    world = ctx.world_size
    gathers = 0
    for unit_node in [n for n in graph.nodes if _is_sharded_unit(n)]:
        layout = ctx.layout(unit_node.meta["fxzero"]["unit"])
        for which, users in [(w, group) for w in (FORWARD, BACKWARD) for group in _use_groups(unit_node, w, layout)]:
            if not users:
                continue
            pos = positions(graph)
            first = min(users, key=pos.__getitem__)
            _, gathered = _gather_before(graph, unit_node, first, which, world)
            for user in users:
                user.replace_input_with(unit_node, gathered)
            pos = positions(graph)
            last = last_user(alias_closure(gathered), pos)
            if last is None or last.op == "output":
                raise ValueError(
                    f"unit {layout.name!r}: a gathered parameter (or a view of one) is a graph "
                    "output, so its buffer can never be freed; return a copy (.clone()) instead"
                )
            with graph.inserting_after(last):
                freed = graph.call_function(OPS["free"], (gathered,))
            tag(freed, kind="free", unit=layout.name, phase=which)
            gathers += 1
        val = unit_node.meta.get("val")
        if val is not None:
            with val.fake_mode:
                unit_node.meta["val"] = torch.empty(layout.shard_numel, dtype=val.dtype)
    return PassResult(gm, changed=gathers > 0, summary={"all_gathers": gathers, "frees": gathers})


PASS = Pass(
    "insert_gather_free",
    insert_gather_free_pass,
    requires=REQUIRES,
    provides=PROVIDES,
)
