"""Activations under a memory budget: each saved tensor kept, recomputed or offloaded.

[Note: planning activations under a budget]
`Activations(memory_budget=B)` bounds the bytes of activations a rank holds between its forward
and its backward (`memory_report()["activations"]` after a forward) by B, at the least added
step time the cost model predicts. Each value the backward reads is kept in memory, recomputed
in the backward (any operator of a unit's interior, matmuls too, random ones replayed: [Note:
recomputing a unit]), or, with `Activations(offload=...)`, written to the tier and read back
([Note: activations on a tier] in `offload_activations.py`). Two steps, one per pass:

1. Recompute (in `separate_phases`): for a price of memory, lambda nanoseconds per byte,
   the minimum cut of [Note: selective recompute] with keeping v costing lambda * bytes(v) and
   recomputing v its predicted time chooses what to recompute; a larger lambda recomputes more.
   The planner tries the lambdas at which some value's choice can flip (each candidate's
   recompute time over its bytes, at most `LAMBDAS` of them) and 0 (recompute nothing) and
   infinity (everything a unit's interior holds), and for each predicts the step's added time:
   the recompute time, plus, for the bytes still over the budget, the offload's writes and
   reads beyond the forward's and the backward's compute they hide behind and the compute they
   slow where they overlap it (`CostModel.io_interference`; infinite without a tier, or where
   what cannot move, a model input or a strided view, is over the budget by itself). It takes the least; recompute-only and offload-only are among the candidates (every
   lambda with nothing offloaded; lambda 0), so the plan is predicted no slower than either.
   Where the least recomputes alone and fits, the lambdas between it and the grid's next lower
   one are bisected for the lowest that still fits: the plan that fills the budget to its edge,
   recomputing least. Each plan bisection tries is checked to fit; that the lowest fitting
   lambda is found rests on the cuts being nested in lambda, as a parametric minimum cut's are.
2. Offload (`plan_offload`, before `offload_activations`): of the tensors still saved, the
   fewest seconds of exposed transfer per byte go to the tier until what stays fits.

A budget nothing meets (what the largest lambda keeps, with nothing offloaded or all that can
be) is an error at compile time naming the least the program can keep. Both steps are in the
pass trace (`budget_*` figures of `separate_phases`, `plan_offload`'s).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import torch
import torch.fx as fx

from fxzero.ir.alias import alias_root
from fxzero.ir.instruction import Instruction
from fxzero.ir.rng import STATE_BYTES
from fxzero.ir.sizes import nbytes
from fxzero.ir.tags import BACKWARD, FORWARD, is_kind, phase
from fxzero.passes.offload_activations import PLACEMENT, _can_offload, saved_tensors
from fxzero.passes.recompute_cut import CutGraph
from fxzero.passes.runner import Pass, PassContext, PassResult

__all__ = ["LAMBDAS", "BudgetError", "BudgetPlan", "make_plan_offload", "plan_offload", "plan_recompute"]

LAMBDAS = 24
"""Most prices of memory tried between 0 and infinity (quantiles of the candidates' own)."""

EDGE_STEPS = 24
"""Most bisection steps between the grid's best price and the one below it."""

TIE_BREAK = 1e-3
"""How far apart the keep costs of alike values are set, relatively, so they flip one at a time."""

_INFINITE = 10 ** 6
"""Nanoseconds per byte past any recompute's price: every candidate is recomputed."""


class BudgetError(ValueError):
    """A memory budget the program cannot meet."""


@dataclasses.dataclass
class BudgetPlan:
    """What step 1 chose, and what it predicted ([Note: planning activations under a budget])."""

    price_ns_per_byte: float
    recomputed: set[fx.Node]
    kept_bytes: int
    recompute_s: float
    offload_bytes: int
    offload_exposed_s: float
    """The step time the offload adds: transfer no compute hides, and compute it slows (`_offload_s`)."""
    tried: int
    fixed_bytes: int = 0
    """Of `kept_bytes`, what cannot move to a tier (model inputs, strided views, generator states)."""

    def summary(self) -> dict:
        return {"budget_price_ns_per_byte": self.price_ns_per_byte, "budget_recomputed": len(self.recomputed),
                "budget_kept_bytes": self.kept_bytes, "budget_recompute_s": self.recompute_s,
                "budget_offload_bytes": self.offload_bytes, "budget_offload_exposed_s": self.offload_exposed_s,
                "budget_prices_tried": self.tried}


def _kept_bytes(nodes) -> int:
    """Bytes of the storages `nodes` hold (a view and its base once), as the runtime counts them."""
    roots = {}
    for n in nodes:
        if isinstance(n.meta.get("val"), (tuple, list)) or n.meta.get("fxzero", {}).get("kept"):
            continue
        root = alias_root(n)
        roots[root] = max(roots.get(root, 0), nbytes(root.meta.get("val")), nbytes(n.meta.get("val")))
    return sum(roots.values())


def _state_bytes(node: fx.Node) -> int:
    """Bytes kept to replay `node` if it is a random operator ([Note: replaying random operators])."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return 0
    val = node.meta.get("val")
    first = val[0] if isinstance(val, (tuple, list)) else val
    return STATE_BYTES.get(first.device.type if isinstance(first, torch.Tensor) else "cpu", 16)


def _transfer_s(cost_model, tier: str, kind: str, n: int) -> float:
    return cost_model.io_seconds(Instruction(name="", kind=kind, stream="io", tier=tier, bytes=n))


def _offload_s(cost_model, tier: str, nbytes: int, forward_s: float, backward_s: float) -> float:
    """The step time offloading `nbytes` adds: the writes beyond the forward's compute and the
    reads beyond the backward's, which nothing hides, and the compute the transfers slow where
    they overlap it (`CostModel.io_interference`: on a CPU rank the I/O threads take cores)."""
    write_s = _transfer_s(cost_model, tier, "offload", nbytes)
    read_s = _transfer_s(cost_model, tier, "fetch", nbytes)
    slowed = getattr(cost_model, "io_interference", 0.0) * (min(write_s, forward_s) + min(read_s, backward_s))
    return max(0.0, write_s - forward_s) + max(0.0, read_s - backward_s) + slowed


def plan_recompute(graph: fx.Graph, *, budget: int, seconds: dict[fx.Node, float], tier: Optional[str],
                   cost_model, interior: Callable[[fx.Node], bool],
                   param_only: Callable[[fx.Node], bool], may_recompute: bool = True) -> BudgetPlan:
    """Step 1 of [Note: planning activations under a budget] (`may_recompute` False: lambda 0 only)."""
    ns = {n: max(1, round(seconds.get(n, 0.0) * 1e9)) for n in graph.nodes}
    forward_s = sum(s for n, s in seconds.items() if phase(n) == FORWARD)
    backward_s = sum(s for n, s in seconds.items() if phase(n) == BACKWARD)
    # Alike units (a model's blocks) make alike values, which one price would flip all at once: a
    # budget between two such flips would be met only by recomputing every block's copy. Each
    # value's keep cost is weighted by 1 + TIE_BREAK * (how early it comes), so the copies flip one
    # unit at a time, the earliest (held longest) first; a price moves by at most TIE_BREAK.
    order = {n: i for i, n in enumerate(graph.nodes)}
    weight = {n: 1.0 + TIE_BREAK * (len(order) - order[n]) / len(order) for n in graph.nodes}
    candidates = [n for n in graph.nodes if n.op == "call_function" and interior(n) and nbytes(n.meta.get("val"))]
    ratios = sorted({ns[n] / (nbytes(n.meta["val"]) * weight[n]) for n in candidates})
    step = max(1, len(ratios) // LAMBDAS)
    prices = [0.0] + ratios[::step] + [float(_INFINITE)] if may_recompute else [0.0]

    network = CutGraph(graph, param_only, recompute_cost=lambda n: ns[n] if interior(n) else None)

    def plan_at(price: float) -> BudgetPlan:
        chosen = network.solve(lambda n: int(price * nbytes(n.meta.get("val")) * weight[n]))
        states = sum(_state_bytes(n) for n in chosen.recomputed)
        kept = _kept_bytes(chosen.kept) + states
        fixed = _kept_bytes(n for n in chosen.kept if not _can_offload(alias_root(n))) + states
        recompute_s = sum(seconds.get(n, 0.0) for n in chosen.recomputed)
        over = max(0, kept - budget)
        if over and (tier is None or fixed > budget):  # (what cannot move to the tier: inputs, strided views)
            exposed = float("inf")
        else:
            exposed = _offload_s(cost_model, tier, over, forward_s, backward_s) if over else 0.0
        return BudgetPlan(price, chosen.recomputed, kept, recompute_s, over, exposed, len(prices), fixed_bytes=fixed)

    def cost(plan: BudgetPlan) -> float:
        return plan.recompute_s + plan.offload_exposed_s

    best, least = None, None
    for price in prices:
        plan = plan_at(price)
        if least is None or (plan.fixed_bytes if tier else plan.kept_bytes) < (least.fixed_bytes if tier else
                                                                              least.kept_bytes):
            least = plan
        if plan.offload_exposed_s != float("inf") and (best is None or cost(plan) < cost(best)):
            best = plan
    if best is not None and best.offload_bytes == 0 and best.price_ns_per_byte > 0:
        best = _to_the_edge(best, max(p for p in prices if p < best.price_ns_per_byte), plan_at, cost)
    if best is None:
        raise BudgetError(_unmet(budget, least, tier, may_recompute))
    return best


def _unmet(budget: int, least: BudgetPlan, tier: Optional[str], may_recompute: bool) -> str:
    """Why no plan meets `budget`, with the least a plan keeps, and what would."""
    how = "with every unit's interior recomputed" if may_recompute else "with nothing recomputed (budget_choices)"
    if tier is None:
        return (f"Activations(memory_budget={budget}) cannot be met without a tier: the least this program can keep "
                f"for its backward is {least.kept_bytes} bytes per rank, {how}. Raise memory_budget, or let the "
                "planner offload too: Activations(offload=fxzero.Nvme(path=...)) with 'offload' in budget_choices")
    return (f"Activations(memory_budget={budget}) cannot be met even with the {tier} tier: {least.fixed_bytes} bytes "
            "per rank of what this program keeps for its backward cannot move to a tier (the model's inputs, views "
            f"that are not the whole of their storage, generator states), {how}. Raise memory_budget: it must be "
            f"at least {least.fixed_bytes}")


def make_plan_offload(*, budget: int, tier: str, cost_model, may_offload: bool = True) -> Pass:
    """Step 2 of [Note: planning activations under a budget], as a pass before `offload_activations`
    (`may_offload` False: every tensor stays, the tier's own rule overruled)."""
    return Pass("plan_offload", functools.partial(plan_offload, budget=budget, tier=tier, cost_model=cost_model,
                                                  may_offload=may_offload),
                requires=frozenset({"phases"}), provides=frozenset({"activations_planned"}))


def saved_values(graph: fx.Graph) -> list[fx.Node]:
    """The forward's values the backward reads (parameters and the gathered buffers kept for the
    backward apart: they are model state, counted elsewhere)."""
    out = []
    for n in graph.nodes:
        if n.op == "output" or phase(n) != FORWARD or is_kind(n, "unit"):
            continue
        if any(u.op != "output" and phase(u) == BACKWARD for u in n.users):
            out.append(n)
    return out


def _to_the_edge(best: BudgetPlan, below: float, plan_at, cost) -> BudgetPlan:
    """The grid's best plan recomputes alone and fits; a price between the grid price `below` it
    (whose plan does not fit without the tier) and its own may fit too, recomputing less. A lower
    price recomputes a subset (the cuts are nested as the price of memory falls), so the lowest
    price that still fits is found by bisection on the price (a group of values flips at its own
    price, which no single value's ratio names): the plan that fills the budget to its edge.
    Taken if predicted no slower."""
    lo, hi, edge, tried = below, best.price_ns_per_byte, best, 0
    for tried in range(1, EDGE_STEPS + 1):
        mid = (lo + hi) / 2
        plan = plan_at(mid)
        if plan.offload_bytes == 0:
            edge, hi = plan, mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * hi:
            break
    edge = edge if cost(edge) <= cost(best) else best
    return dataclasses.replace(edge, tried=best.tried + tried)


def plan_offload(gm: fx.GraphModule, ctx: PassContext, *, budget: int, tier: str, cost_model,
                 may_offload: bool = True) -> PassResult:
    held = _kept_bytes(saved_values(gm.graph))
    rows = saved_tensors(gm, ctx, tier=tier, cost_model=cost_model)
    if tier == "cpu" and all(n.meta["val"].device.type == "cpu" for n in saved_values(gm.graph)
                             if hasattr(n.meta.get("val"), "device")):
        rows = []  # (a CPU program's activations are in host memory already: the cpu tier moves nothing)

    def exposed_per_byte(s) -> float:
        return (max(0.0, s.write_s - s.forward_gap_s) + max(0.0, s.read_s - s.backward_gap_s)) / max(1, s.bytes)

    placement, moved = {}, 0
    for s in sorted(rows, key=exposed_per_byte):
        if held - moved <= budget or not may_offload:
            placement[s.name] = "keep"
            continue
        placement[s.name] = tier
        moved += s.bytes
    if held - moved > budget:
        raise BudgetError(
            f"Activations(memory_budget={budget}) cannot be met: after recompute the program keeps {held} bytes "
            f"per rank for its backward and can move {moved} of them to {tier}; the least it can hold is "
            f"{held - moved} bytes. Raise memory_budget")
    ctx.outputs[PLACEMENT] = placement
    return PassResult(gm, changed=False, summary={"held_bytes": held, "offload_bytes": moved, "budget": budget,
                                                  "offloaded": sum(1 for w in placement.values() if w == tier)})
