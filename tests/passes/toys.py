"""Toy models and small helpers shared by the single-process pass tests.

Every model is built under `torch.device("meta")` (the way users are told to build them), its
example inputs are meta tensors, and everything the compiler does to them runs on fake tensors.
`pipeline_upto` runs the stage's real pipeline (built by `build_pipeline`, prefetch off) up to and
including a named pass, so a test can look at the graph a pass received (Before) and the one it
produced (After).

Results are cached and shared between tests: treat them as read-only.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fxzero
from fxzero.config import UnitsPolicy
from fxzero.passes import build_pipeline
from fxzero.ir.alias import alias_source
from fxzero.passes.runner import Pass, PassContext, PassRecord, run_pipeline
from fxzero.trace import TracedJoint, trace_joint
from fxzero.ir.layout import UnitLayout
from fxzero.units import plan_units

META = torch.device("meta")
WORLD_SIZES = (1, 2, 4)
STAGES = (1, 2, 3)
PASS_NAMES = ("partition", "separate_phases", "insert_gather_free", "insert_reduce_scatter", "split")
"""The passes these tests check, in pipeline order (the pipeline may hold others between them)."""


# ---------------------------------------------------------------------------------------------
# Models


def mlp() -> nn.Module:
    """Three Linears with ReLUs between: units "0", "2", "4" (no root unit)."""
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.relu(self.fc(self.norm(h)))


class TiedLM(nn.Module):
    """Embedding, a ModuleList of two blocks, a final norm and a head tied to the embedding."""

    def __init__(self, vocab: int = 10, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def bn_net() -> nn.Module:
    """Linear -> ReLU -> BatchNorm1d -> Linear: units "0", "2" (the norm) and "3"."""
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.BatchNorm1d(8), nn.Linear(8, 3))


class FrozenNet(nn.Module):
    """layers.1 wholly frozen; layers.2's weight frozen but its bias trained."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)])
        self.layers[1].requires_grad_(False)
        self.layers[2].weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.layers[0](x))
        x = F.relu(self.layers[1](x))
        return self.layers[2](x)


class UnusedNet(nn.Module):
    """A root parameter the output never reads (it gets no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 3)])
        self.unused = nn.Parameter(torch.ones(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](F.relu(self.layers[0](x)))


class ChunkedWeight(nn.Module):
    """Uses its weight through split/getitem views: the gathered buffer's aliases go deeper."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, bottom = self.weight.chunk(2)
        return x @ top.t() + (x @ bottom.t()).relu()


class NoParams(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class WeightDropout(nn.Module):
    """DropConnect: dropout on the weight itself, so the mask depends on the parameter only."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, F.dropout(self.lin.weight, 0.5, self.training))


@dataclasses.dataclass(frozen=True)
class Toy:
    build: Callable[[], nn.Module]
    make_input: Callable[[torch.Generator], torch.Tensor]
    """A real input from a generator; its shape and dtype are the example input's."""


def _floats(*shape: int) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda gen: torch.randn(shape, generator=gen)


TOYS: dict[str, Toy] = {
    "mlp": Toy(mlp, _floats(5, 4)),
    "tied": Toy(TiedLM, lambda gen: torch.randint(0, 10, (2, 5), generator=gen)),
    "bn": Toy(bn_net, _floats(6, 4)),
    "frozen": Toy(FrozenNet, _floats(5, 4)),
    "unused": Toy(UnusedNet, _floats(5, 4)),
    "chunked": Toy(ChunkedWeight, _floats(3, 4)),
    "no_params": Toy(NoParams, _floats(2, 3)),
    "weight_dropout": Toy(WeightDropout, _floats(4, 4)),
}
MODELS_WITH_PARAMS = ("mlp", "tied", "bn", "frozen", "unused", "chunked")


def build(name: str) -> nn.Module:
    with META:
        return TOYS[name].build()


def example_inputs(name: str) -> list[torch.Tensor]:
    x = TOYS[name].make_input(torch.Generator().manual_seed(0))
    return [torch.empty_like(x, device=META)]


def real_input(name: str, seed: int) -> torch.Tensor:
    return TOYS[name].make_input(torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# Running the compiler


@dataclasses.dataclass
class Run:
    """The pipeline of one stage run up to some pass."""

    model: nn.Module
    gm: fx.GraphModule
    ctx: PassContext
    records: list[PassRecord]

    @property
    def signature(self):
        return self.ctx.signature

    @property
    def layouts(self) -> list[UnitLayout]:
        return self.ctx.layouts


@functools.lru_cache(maxsize=None)
def traced(name: str) -> TracedJoint:
    """The joint trace of a toy, untouched by any pass (do not run passes on it)."""
    return trace_joint(build(name), example_inputs(name))


def baseline_config(stage: int) -> fxzero.Config:
    """The stage's config without prefetch: the pipeline these tests check, pass by pass.

    Prefetch (on by default) only moves gathers and reduce-scatter waits; it has tests of its own.
    """
    return fxzero.Config(stage=stage, prefetch=None)


def passes_by_name(stage: int, layouts: list[UnitLayout]) -> dict[str, Pass]:
    return {p.name: p for p in build_pipeline(baseline_config(stage), layouts)}


def pipeline_upto(name: str, upto: Optional[str], *, stage: int = 3, world_size: int = 2) -> Run:
    """A fresh trace of toy `name` run through the stage's pipeline up to pass `upto` (None: none)."""
    model = build(name)
    tr = trace_joint(model, example_inputs(name))
    layouts = plan_units(model, UnitsPolicy(), world_size)
    ctx = PassContext(layouts=layouts, signature=tr.signature, world_size=world_size)
    passes = build_pipeline(baseline_config(stage), layouts)
    names = [p.name for p in passes]
    passes = passes[: names.index(upto) + 1] if upto is not None else []
    gm, records = run_pipeline(tr.gm, ctx, passes)
    return Run(model, gm, ctx, records)


@functools.lru_cache(maxsize=None)
def cached_pipeline(name: str, upto: Optional[str], stage: int = 3, world_size: int = 2) -> Run:
    return pipeline_upto(name, upto, stage=stage, world_size=world_size)


@functools.lru_cache(maxsize=None)
def compiled(
    name: str, stage: int = 3, world_size: int = 2, *, prefetch: bool = False
) -> fxzero.CompiledProgram:
    """compile_program on a toy; with prefetch=True under the default Config (prefetch on)."""
    config = fxzero.Config(stage=stage) if prefetch else baseline_config(stage)
    return fxzero.compile_program(build(name), example_inputs(name), config, world_size=world_size)


# ---------------------------------------------------------------------------------------------
# Looking at graphs


def kind(node: fx.Node) -> Optional[str]:
    return node.meta.get("fxzero", {}).get("kind")


def meta_of(node: fx.Node) -> dict:
    return node.meta.get("fxzero", {})


def of_kind(gm: fx.GraphModule, *kinds: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if kind(n) in kinds]


def placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def output_args(gm: fx.GraphModule) -> list:
    return list(next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0])


def positions(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def alias_root(node: fx.Node) -> fx.Node:
    """The node that owns the storage `node`'s value views."""
    while (src := alias_source(node)) is not None:
        node = src
    return node


def depends_only_on_units(node: fx.Node) -> bool:
    """Whether node's value is computed from unit placeholders alone (a parameter-derived value)."""
    if node.op == "placeholder":
        return kind(node) == "unit"
    if node.op != "call_function" or not node.all_input_nodes:
        return False
    return all(depends_only_on_units(i) for i in node.all_input_nodes)
