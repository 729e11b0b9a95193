"""fxzero: the model is built on the meta device and compiled; the engine runs ZeRO-3.

Initial weights, by `init` in the system's options:
- "state_dict" (default): the eager model built from the benchmark's seed, as every other
  system builds it, is handed over as `fxzero.compile(meta_model, config, state_dict=...)` and
  dropped after compile. Its full copy counts in this rank's peak RSS, as it does for the others.
- "seed": no full copy anywhere: each rank's shard is initialized by the model's own init
  (`reset_parameters()`, `_init_weights`) under `Config(seed=...)`, which reproduces eager
  construction.

Config knobs come from the system table (`systems.py`) as `fxzero.Config(..., **config)`; a knob
this fxzero does not have makes the system unavailable (checked before any rank starts). Three take
a JSON-friendly value that `make_config` turns into the object: "prefetch" (a dict of
`fxzero.Prefetch` fields), "activations" (a dict of `fxzero.Activations` fields, e.g.
{"recompute": "unit"}: a recompute mode this fxzero lacks makes the system unavailable, with
Activations' own message) and "mixed_precision" (a name from `MIXED_PRECISION`: "bf16" is
`fxzero.MixedPrecision(param_dtype=torch.bfloat16)`, gradients reduced in its default fp32).
With mixed precision the engine's outputs are bf16; the loss is computed in fp32 from them
(`common.lm_loss`), as for every system.

Offload, by `offload` in the system's options (the placement DeepSpeed's offload systems use):
- None (default): every state on the device.
- "cpu": `Offload(params=Cpu(), optimizer=Cpu())`.
- "nvme": `Offload(params=Nvme(path=DIR), optimizer=Nvme(path=DIR))`, DIR a fresh folder from
  `common.nvme_scratch` (the parent DeepSpeed's NVMe system uses), removed after the run; the
  engine keeps its files in its own subfolder and removes them at `engine.close()`.
`offload_options` are further `fxzero.Offload` fields (e.g. {"step_in_backward": True}); one this
fxzero lacks makes the system unavailable, as a Config knob does. The engine's offload I/O figures are reported when it has them (`engine.io_report()`).

Traffic is the engine's own `comm_report()`; the wrapped torch.distributed collectives count
the same calls independently (reported beside it by the worker).
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist

import fxzero
from tools.bench.commcount import CommCounter
from tools.bench.common import build_model, lm_loss, nvme_scratch
from tools.bench.spec import RunSpec

COUNTED_BY = "fxzero engine.comm_report(): all_gather output + reduce_scatter input elements"


OFFLOADS = (None, "cpu", "nvme")

MIXED_PRECISION: dict[str, dict[str, Any]] = {
    "bf16": {"param_dtype": torch.bfloat16},  # reduce_dtype: MixedPrecision's default, fp32
}
"""The system table's "mixed_precision" names -> `fxzero.MixedPrecision` fields (a dtype cannot
go through JSON)."""


def make_mixed_precision(name: Any) -> "fxzero.MixedPrecision":
    """The `fxzero.MixedPrecision` a "mixed_precision" name stands for.

    Raises ValueError for a name not in `MIXED_PRECISION`, TypeError when this fxzero has no
    mixed precision (no `fxzero.MixedPrecision`).
    """
    if not isinstance(name, str) or name not in MIXED_PRECISION:
        raise ValueError(f"fxzero runner: mixed_precision must be one of {sorted(MIXED_PRECISION)}, got {name!r}")
    if not hasattr(fxzero, "MixedPrecision"):
        raise TypeError("this fxzero has no fxzero.MixedPrecision (mixed precision is not implemented)")
    return fxzero.MixedPrecision(**MIXED_PRECISION[name])


def make_offload(
    offload: Optional[str], nvme_path: Optional[str], options: Optional[dict[str, Any]] = None
) -> Optional["fxzero.Offload"]:
    """The `fxzero.Offload` for an `offload` option: None, "cpu" or "nvme" (files under
    `nvme_path`), with further Offload fields from `options`. None for None, so that Config
    keeps its default.

    Raises ValueError for another option (or options without offload), TypeError when this
    fxzero has no offload API or no such Offload field.
    """
    if offload not in OFFLOADS:
        raise ValueError(f"fxzero runner: offload must be None, 'cpu' or 'nvme', got {offload!r}")
    options = options or {}
    if offload is None:
        if options:
            raise ValueError(f"fxzero runner: offload_options {options} need offload 'cpu' or 'nvme'")
        return None
    if not all(hasattr(fxzero, name) for name in ("Offload", "Cpu", "Nvme")):
        raise TypeError("this fxzero has no fxzero.Offload / Cpu / Nvme (offload is not implemented)")
    if offload == "cpu":
        return fxzero.Offload(params=fxzero.Cpu(), optimizer=fxzero.Cpu(), **options)
    assert nvme_path is not None
    return fxzero.Offload(params=fxzero.Nvme(path=nvme_path), optimizer=fxzero.Nvme(path=nvme_path), **options)


def make_config(
    spec: RunSpec,
    config: dict[str, Any],
    offload: Optional[str] = None,
    nvme_path: Optional[str] = None,
    offload_options: Optional[dict[str, Any]] = None,
) -> "fxzero.Config":
    """`fxzero.Config(stage=3, optimizer=AdamW(spec's), seed=spec.seed, offload=..., **config)`.

    "prefetch" may be a dict of `fxzero.Prefetch` fields, "activations" one of
    `fxzero.Activations` fields, "mixed_precision" a name from
    `MIXED_PRECISION`. Raises TypeError (from the dataclass) for a knob this fxzero does not
    have, ValueError for a value it rejects.
    """
    adamw = fxzero.AdamW(lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
    kwargs = {"stage": 3, "optimizer": adamw, "seed": spec.seed, **config}
    if isinstance(kwargs.get("prefetch"), dict):  # the Prefetch knobs, e.g. {"keep_for_backward": False}
        kwargs["prefetch"] = fxzero.Prefetch(**kwargs["prefetch"])
    if isinstance(kwargs.get("activations"), dict):  # the Activations knobs, e.g. {"recompute": "unit"}
        if not hasattr(fxzero, "Activations"):
            raise TypeError("this fxzero has no fxzero.Activations (activation recompute is not implemented)")
        kwargs["activations"] = fxzero.Activations(**kwargs["activations"])
    if kwargs.get("mixed_precision") is not None:  # a name, e.g. "bf16" (MIXED_PRECISION)
        kwargs["mixed_precision"] = make_mixed_precision(kwargs["mixed_precision"])
    placement = make_offload(offload, nvme_path, offload_options)
    if placement is not None:
        kwargs["offload"] = placement
    return fxzero.Config(**kwargs)


class FxzeroTrainer:
    def __init__(self, spec: RunSpec, counter: CommCounter, options: dict[str, Any]) -> None:
        init = options.get("init", "state_dict")
        if init not in ("state_dict", "seed"):
            raise ValueError(f"fxzero runner: init must be 'state_dict' or 'seed', got {init!r}")
        self.offload: Optional[str] = options.get("offload")
        self.nvme_path: Optional[str] = None
        self.engine = None
        if self.offload == "nvme":
            self.nvme_path = nvme_scratch(f"bench-fxzero-nvme-rank{dist.get_rank()}-")
        try:
            config = make_config(
                spec, options.get("config", {}), self.offload, self.nvme_path, options.get("offload_options")
            )
            self.mixed_precision = getattr(config, "mixed_precision", None)
            self.activations = getattr(config, "activations", None)
            state_dict: Optional[dict[str, torch.Tensor]] = None
            if init == "state_dict":
                state_dict = build_model(spec).state_dict()
            self.init = init
            self.engine = fxzero.compile(build_model(spec, device="meta"), config, state_dict=state_dict)
            del state_dict
        except BaseException:
            self.close()  # the worker never sees this trainer: remove the scratch folder here
            raise
        gc.collect()
        self.memory: dict[str, int] = {}

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = lm_loss(self.engine(x), y)
        self.engine.backward(loss)
        self.memory = self.engine.memory_report()  # gradients held, before the step frees them
        self.engine.step()
        return loss.item()

    def reset_counters(self) -> None:
        self.engine.comm_report(reset=True)
        io_report = getattr(self.engine, "io_report", None)
        if callable(io_report) and "reset" in inspect.signature(io_report).parameters:
            io_report(reset=True)  # from here on: the timed steps' I/O only

    def report(self) -> dict[str, Any]:
        out = {
            "init": self.init,
            "num_params": self.engine.num_params,
            "engine_comm": self.engine.comm_report(),
            "engine_comm_counted_by": COUNTED_BY,
            "memory_report": self.memory,
            "offload": self.offload,
        }
        if self.activations is not None:  # the policy as the engine has it (its defaults included)
            out["activations_policy"] = {f.name: _plain(getattr(self.activations, f.name))
                                  for f in dataclasses.fields(self.activations)}
        mp = self.mixed_precision
        if mp is not None:
            out["mixed_precision"] = {"param_dtype": str(mp.param_dtype), "reduce_dtype": str(mp.reduce_dtype)}
        io_report = getattr(self.engine, "io_report", None)
        if callable(io_report):  # fxzero with offload: bytes read and written per tier
            out["engine_io"] = io_report()
        return out

    def close(self) -> None:
        """Close the engine (it removes its offload files), then the scratch folder."""
        try:
            close = getattr(self.engine, "close", None)
            if callable(close):
                close()
        finally:
            if self.nvme_path:
                shutil.rmtree(self.nvme_path, ignore_errors=True)
                self.nvme_path = None

    def predict(self) -> dict[str, Any]:
        """The cost model's predicted step time, when fxzero has one (see `_predict`)."""
        return _predict(self.engine)


def _plain(value: Any) -> Any:
    """A JSON value as is; anything else (a tier object, a dtype) as its repr."""
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


def _predict(engine) -> dict[str, Any]:
    """The simulator's step time for the engine's schedule, when fxzero has a cost model.

    Uses `fxzero.cost.simulate(schedule, cost_model)` with, in order of preference: the cost
    model the engine already holds (`engine.cost_model`, calibrated when it started), or one
    from `CostModel.calibrate()` / `fxzero.cost.calibrate(comm=engine.comm)` (a collective: every
    rank calls this). Returns {} when fxzero has no such API, so the JSON line simply lacks the
    prediction; a failure inside the cost model is reported, not raised, since the measurement
    itself is done by then.
    """
    try:
        from fxzero import cost
    except ImportError:
        return {}
    simulate = getattr(cost, "simulate", None)
    model_cls = getattr(cost, "CostModel", None)
    if not callable(simulate) or model_cls is None:
        return {}
    try:
        cost_model = getattr(engine, "cost_model", None)
        source = "engine.cost_model"
        if not isinstance(cost_model, model_cls):
            if callable(getattr(model_cls, "calibrate", None)):
                cost_model, source = model_cls.calibrate(), "CostModel.calibrate()"
            elif callable(getattr(cost, "calibrate", None)):
                cost_model, source = cost.calibrate(comm=engine.comm), "fxzero.cost.calibrate(comm)"
            else:
                return {}
        result = simulate(engine.schedule, cost_model)
        out: dict[str, Any] = {"predicted_step_s": _seconds(result), "predicted_with": source}
        if callable(getattr(result, "summary", None)):
            out["predicted_detail"] = result.summary()
        return out
    except Exception as exc:  # the cost model is another engineer's work in progress
        return {"predicted_error": f"{type(exc).__name__}: {exc}"}


def _seconds(result: Any) -> float:
    """A step time in seconds from whatever `simulate` returns: a number or an object/dict."""
    if isinstance(result, (int, float)):
        return float(result)
    for name in ("step_seconds", "step_s", "total_s", "makespan_s", "seconds", "makespan", "total"):
        value = result.get(name) if isinstance(result, dict) else getattr(result, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    raise TypeError(f"cannot read a step time from simulate()'s {type(result).__name__}")


def setup(spec: RunSpec, counter: CommCounter, options: dict[str, Any]) -> FxzeroTrainer:
    return FxzeroTrainer(spec, counter, options)
