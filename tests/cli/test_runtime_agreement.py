"""What the CLI shows is what the runtime runs: same schedule, same memory accounting.

Two gloo ranks train one step of the same model that `fxzero compile` compiled for a world of
two; the engine's schedule JSON must equal the recorded schedule.json byte for byte, and its
counted model states must equal `fxzero estimate`'s runtime accounting.
"""

from __future__ import annotations

import json
import os

from tests.cli.conftest import TINY, WORLD, invoke
from tests.dist.harness import run_ranks


def _train_one_step(rank: int, world: int, spec: str):
    import torch

    import fxzero
    from fxzero.modelspec import build_model, example_inputs

    torch.manual_seed(0)
    model = build_model(spec)
    # "measure" (the default) would time this machine's collectives; the CLI compiles without
    # ranks and keeps the native ones, as cost_model=None does.
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None))
    xs = example_inputs(model)
    engine.backward(engine(*xs).square().mean())
    engine.step()
    engine.backward(engine(*xs).square().mean())  # gradients held, optimizer states allocated
    return engine.schedule.dumps(), engine.memory_report()["model_states"]


def test_engine_runs_exactly_the_recorded_schedule(tiny_dir, runner):
    results = run_ranks(_train_one_step, WORLD, TINY, timeout_s=240)
    recorded = open(os.path.join(tiny_dir, "schedule.json")).read()
    for schedule_json, _ in results:
        assert schedule_json == recorded
    shown = invoke(runner, "schedule", tiny_dir, "--json").stdout.rstrip("\n")
    assert shown == results[0][0]
    est = json.loads(invoke(runner, "estimate", TINY, "--world", str(WORLD), "--json").stdout)
    stage3 = next(r for r in est["per_rank"] if r["stage"] == 3)
    assert [m for _, m in results] == [stage3["fp32"]["total"]] * WORLD
