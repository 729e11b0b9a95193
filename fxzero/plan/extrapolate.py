"""A deep model priced from two shallow compiles: its program at 2 and at 3 blocks, extrapolated.

[Note: pricing by depth]
A decoder of L identical blocks is one unit per block, each gathered, computed, freed and
reduced the same way, so what the program costs grows by the same amount with every block
after the first two: the step of L blocks is the 2-block step plus L - 2 times the difference
between the 3-block and the 2-block step. The same holds for what the program holds at once:
the peak memory per rank grows by the per-block growth of the peak from 2 to 3 blocks (a
block's parameter, gradient and optimizer shards, and what its forward keeps for the backward,
since the peak is where the forward's activations of every block are alive: the start of the
backward). Two blocks, not one, are the base: the first block is the one whose gather nothing
hides, and the last sits next to the head's reduction, so only from the second block on is each
one like the next. Compiling 2 and 3 blocks instead of 80 keeps a 70B model to seconds.

Where the first blocks are unlike the rest in the program, the base moves deeper:
`steady_depth` compiles 2, 3 and 4 blocks and uses 2 and 3 only where the increment from 3 to 4
blocks repeats the one from 2 to 3 (within `STEADY_RTOL`), else tries 3, 4 and 5, and so on
(`fxzero plan` does; `tools/check_published.py` keeps 2 and 3: its rows offload nothing, and
without offload 2 and 3 blocks extrapolate Llama 3 8B's shape to a full compile of 8). With the parameters offloaded, for one, the backward keeps the shards of its
first two units from the forward: at 2 blocks that is every block, and the increments hold from
4 blocks on (Llama 3 8B's shape: 32 ms a block from 2 to 3 against 36 ms from 4 on).

Where a model's repeated blocks are not alike (`repeated_blocks` finds none), it is compiled at
its own depth. `tools/check_published.py` checks this pricing against published cluster
results; tests/cli/test_plan.py against a full compile (4 blocks compiled, and extrapolated
from 2 and 3: equal).
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fxzero import cost, estimate
from fxzero.artifacts import memory_record
from fxzero.compiler import compile_program
from fxzero.config import Config, UnitsPolicy
from fxzero.schedule.compiled import CompiledProgram
from fxzero.schedule.types import Schedule
from fxzero.units import plan_units

__all__ = ["BASE_DEPTHS", "NextTokenLoss", "Priced", "compile_at_depth", "device_peak_bytes", "extrapolate",
           "micro_and_step", "price", "repeated_blocks", "steady_depth", "with_depth"]

BASE_DEPTHS = (2, 3)
"""The depths a deep model is compiled at ([Note: pricing by depth])."""


class NextTokenLoss(nn.Module):
    """A language model's training step as one program: logits, then the cross-entropy against
    `targets`. The loss belongs in the program: its softmax over a large vocabulary is a
    memory-bound kernel a small model spends real time in, and its logits and their gradient
    are among the largest tensors a step holds."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(idx)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def repeated_blocks(model: nn.Module, units: UnitsPolicy = UnitsPolicy()) -> Optional[tuple[str, int]]:
    """(FQN of the module list, its length) of the model's repeated blocks: the largest list
    whose items are each a unit under `units` and all alike (the same parameter names, shapes
    and dtypes), so that dropping its last items leaves a shallower model of the same kind. None
    where there is no such list of 2 or more."""
    unit_names = {lay.name for lay in plan_units(model, units, 1)}
    best: Optional[tuple[int, str, int]] = None
    for fqn, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        names = [f"{fqn}.{name}" if fqn else name for name, _ in module.named_children()]
        if not all(n in unit_names for n in names):
            continue
        shapes = {tuple((n, tuple(p.shape), p.dtype) for n, p in child.named_parameters()) for child in module}
        if len(shapes) != 1:
            continue
        numel = sum(p.numel() for p in module.parameters())
        if best is None or numel > best[0]:
            best = (numel, fqn, len(module))
    return None if best is None else (best[1], best[2])


def with_depth(model: nn.Module, fqn: str, depth: int) -> nn.Module:
    """`model` with only the first `depth` items of its module list `fqn`: the modules on the way
    to it are shallow copies (their children dicts new), everything else is shared, so the model
    itself is unchanged and nothing is allocated. `fqn` "" is the model itself (an `nn.Sequential`
    of blocks): its copy keeps its first `depth` items."""
    root = copy.copy(model)
    if not fqn:
        root._modules = dict(list(model._modules.items())[:depth])
        return root
    root._modules = dict(model._modules)
    parent, parts = root, fqn.split(".")
    for name in parts[:-1]:
        child = copy.copy(parent._modules[name])
        child._modules = dict(child._modules)
        parent._modules[name] = child
        parent = child
    kept = list(parent._modules[parts[-1]])[:depth]
    parent._modules[parts[-1]] = nn.ModuleList(kept) if isinstance(parent._modules[parts[-1]], nn.ModuleList) \
        else nn.Sequential(*kept)
    return root


def compile_at_depth(model: nn.Module, depth: Optional[int], args: Sequence[Any], config: Config, *,
                     world_size: int, device: str = "cpu", kwargs: Optional[Mapping[str, Any]] = None,
                     blocks: Optional[str] = None) -> CompiledProgram:
    """The program of `model` with `depth` of its repeated blocks (`blocks`: the list's FQN, from
    `repeated_blocks`; depth None: the model as it is), compiled on fake tensors for
    `world_size` ranks of `device`, the compiler's warnings (about settings a rank would meet
    at run time) left out."""
    if depth is not None:
        if blocks is None:
            raise ValueError("compile_at_depth with a depth needs blocks=, the FQN of the model's repeated blocks "
                             "(repeated_blocks(model))")
        model = with_depth(model, blocks, depth)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compile_program(model, tuple(args), config, world_size=world_size, device=device, kwargs=kwargs)


def micro_and_step(schedule: Schedule, model: cost.CostModel) -> tuple[float, float]:
    """(seconds of one micro-step: until the step program starts; seconds of the step program)."""
    sim = cost.simulate(schedule, model)
    step_start = min((e.start for e in sim.events if e.program == "step"), default=sim.step_seconds)
    return step_start, sim.step_seconds - step_start


@dataclasses.dataclass(frozen=True)
class Priced:
    """What one micro-step of a compiled program costs one rank."""

    micro_seconds: float
    """Forward and backward (until the step program starts)."""
    step_seconds: float
    """The step program (the optimizer update), once per optimizer step."""
    peak_bytes: float
    """The device memory the rank holds at its highest: model states on the device, plus the
    largest sum of gathered parameters, activations and gradients at one instruction."""
    forward_flops: float
    """FLOPs of the forward program (torch's formulas; matmuls and attention)."""


def device_peak_bytes(compiled: CompiledProgram, config: Config) -> int:
    """Peak device memory per rank of `compiled` under `config`: the model states `config.offload`
    leaves on the device (`estimate.place`; gradients are in the timeline), buffers, and the
    highest point of the gathered + activations + gradients timeline (`fxzero.liveness`, as
    `fxzero schedule` reports it)."""
    schedule = compiled.schedule
    record = memory_record(compiled, schedule.stage, config.optimizer, config.mixed_precision)
    ms = record["model_states"]
    states = estimate.ModelStates(params=ms["params"], grads=0, optimizer=ms["optimizer"])
    on_device = estimate.place(states, schedule.stage, config.offload).device + ms["buffers"]
    transient = 0
    for program in schedule.programs:
        live = record["programs"][program.name]
        for i, gathered in enumerate(program.gathered_bytes):
            transient = max(transient, gathered + live["activations"][i] + live["gradients"][i])
    return int(on_device + transient)


def price(compiled: CompiledProgram, config: Config, model: cost.CostModel) -> Priced:
    """One micro-step of `compiled` on `model`'s hardware: times, peak memory and FLOPs."""
    micro, step = micro_and_step(compiled.schedule, model)
    flops = sum(i.flops for i in compiled.schedule.program("forward").instructions)
    return Priced(micro, step, device_peak_bytes(compiled, config), float(flops))


def extrapolate(two, three, depth: int, base: int = 2):
    """The value at `depth` blocks from the values at `base` and `base` + 1 blocks ([Note:
    pricing by depth]): `two + (depth - base) * (three - two)`, for numbers or field by field for
    `Priced`."""
    if isinstance(two, Priced):
        return Priced(*(extrapolate(getattr(two, f.name), getattr(three, f.name), depth, base)
                        for f in dataclasses.fields(Priced)))
    return two + (depth - base) * (three - two)


STEADY_RTOL = 1e-3
"""Two per-block increments are the same when they differ by less than this share of the step
(micro-step plus step program) and of the peak."""


def _same_increment(a: Priced, b: Priced, c: Priced) -> bool:
    """Whether b - a and c - b agree ([Note: pricing by depth]: where the blocks are alike)."""
    seconds = STEADY_RTOL * (c.micro_seconds + c.step_seconds)
    return (abs((c.micro_seconds - b.micro_seconds) - (b.micro_seconds - a.micro_seconds)) <= seconds
            and abs((c.step_seconds - b.step_seconds) - (b.step_seconds - a.step_seconds)) <= seconds
            and abs((c.peak_bytes - b.peak_bytes) - (b.peak_bytes - a.peak_bytes)) <= STEADY_RTOL * c.peak_bytes)


def steady_depth(price_at: Callable[[int], Priced], depth: int, *, start: int = BASE_DEPTHS[0],
                 limit: int = 8) -> tuple[int, dict[int, Priced]]:
    """The first base k >= `start` from which a block costs what the next does: the increments
    from k to k + 1 and from k + 1 to k + 2 blocks agree. Where the first blocks are unlike the
    rest (an offloaded model keeps the shards of the units the backward needs first from the
    forward, so at 2 blocks every unit is kept and at 3 not), 2 and 3 blocks would extrapolate
    the unlike ones. Returns k and every depth priced on the way (`price_at(n)`); stops at
    `limit` blocks or the model's `depth`, whichever is less, with the last k tried."""
    priced: dict[int, Priced] = {}
    k = start
    while True:
        for n in (k, k + 1, k + 2):
            if n not in priced and n <= depth:
                priced[n] = price_at(n)
        if k + 2 >= min(depth, limit) or _same_increment(priced[k], priced[k + 1], priced[k + 2]):
            return k, priced
        k += 1
