"""What the commands share: error reporting, the tracing options, and DIR|MODEL sources."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import time
from typing import Iterator, Optional, Sequence

import click

from fxzero.artifacts import ArtifactError, Artifacts, record
from fxzero.modelspec import CallSpec, SpecError, build_model, example_call, parse_call, parse_model
from fxzero.modelspec.hf import config_record
from fxzero.viz.render import DotError

__all__ = ["CLIError", "compile_source", "describe_hardware", "load_source", "reports_errors", "trace_options"]

DEFAULT_WORLD = 8

DEFAULT_HARDWARE = "cpu-loopback"
"""The `fxzero.cost` preset `fxzero schedule` simulates unless told otherwise (--simulate)."""

# What each `fxzero.cost.PRESETS` entry stands for, in words, for the summary. The cost model
# carries figures only; a preset without an entry here is described by its figures alone.
HARDWARE_DESCRIPTIONS = {
    "cpu-loopback": "this kind of box: 2 CPU cores, gloo over loopback, one thread per rank",
    "h100x8-nvlink": "8 x H100 SXM on NVLink 4, fp32 without tensor cores",
    "h100x64-ib400": "64 x H100 (8 nodes) on 400 Gb/s InfiniBand, fp32 without tensor cores",
    "a100-40gb": "A100 SXM 40 GB, nodes of 8 on NVLink 3, 8 x 200 Gb/s RoCE per node",
    "a100-80gb": "A100 SXM 80 GB, nodes of 8 on NVLink 3, 8 x 200 Gb/s RoCE per node",
    "h100-80gb": "H100 SXM 80 GB, nodes of 8 on NVLink 4, 400 Gb/s InfiniBand per GPU",
    "h200-141gb": "H200 SXM 141 GB, nodes of 8 on NVLink 4, 400 Gb/s InfiniBand per GPU",
}


class CLIError(click.ClickException):
    """A mistake of the user's, shown as one line `Error: ...` with exit code 1."""


# Errors a person can act on: shown as their message, never as a traceback.
USER_ERRORS = (SpecError, ArtifactError, DotError, FileNotFoundError, IsADirectoryError, PermissionError)


@contextlib.contextmanager
def reports_errors(what: str = "") -> Iterator[None]:
    """Turn the user's mistakes into one-line CLIErrors (`fxzero --traceback` shows the stack)."""
    ctx = click.get_current_context(silent=True)
    show_traceback = bool(ctx and ctx.find_root().params.get("traceback"))
    try:
        yield
    except click.ClickException:
        raise
    except USER_ERRORS as e:
        if show_traceback:
            raise
        message = str(e) if not isinstance(e, OSError) or not e.filename else f"{e.filename}: {e.strerror}"
        raise CLIError(message) from e
    except (ValueError, TypeError) as e:
        # fxzero's own checks raise these with a message that names the way out (STYLE.md).
        if show_traceback:
            raise
        prefix = f"{what}: " if what else ""
        raise CLIError(f"{prefix}{e} (run `fxzero --traceback ...` for the stack)") from e


INPUTS_HELP = (
    "The call MODEL is traced on. A tensor is DTYPE[SHAPE], with :LOW..HIGH for integers (HIGH "
    "exclusive): 'int64[2,128]:0..50257', 'float32[8,3,32,32]'; positional inputs come first, then "
    "keyword ones, NAME=DTYPE[SHAPE], and keyword constants, NAME=true|false|none|NUMBER: "
    "'input_ids=int64[2,128]:0..50257 labels=int64[2,128]:0..50257 use_cache=false'. Separate items "
    "with spaces or ';', or repeat the option. Default: the model's example_inputs(); for a "
    "transformers: MODEL, input_ids=int64[2,T]:0..vocab_size with T = min(128, max_position_embeddings), "
    "or pixel_values=float32[2,C,S,S] for an image model (num_channels, image_size or 224). A "
    "transformers: MODEL whose forward takes use_cache also gets use_cache=false unless the spec names it."
)

MODEL_CONFIG_HELP = (
    "For a transformers:ClassName MODEL: its config (ClassName.config_class), as a JSON object, e.g. "
    "'{\"n_layer\": 2, \"n_embd\": 64}', or the path of a config.json (the file or its folder). "
    "Nothing is downloaded. Default: the config class's defaults; literal arguments, "
    "'transformers:GPT2LMHeadModel(n_layer=2)', override fields."
)


def trace_options(fn):
    """--world, --stage, --config, --model-config and --inputs: everything tracing a MODEL needs."""

    @click.option("--world", type=click.IntRange(min=1), default=None,
                  help=f"World size to compile for (default {DEFAULT_WORLD}); no ranks are launched.")
    @click.option("--stage", type=click.Choice(["1", "2", "3"]), default=None,
                  help="ZeRO stage (default 3, or the --config file's).")
    @click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
                  help="A DeepSpeed-style JSON config (zero_optimization.stage, optimizer).")
    @click.option("--model-config", "model_config", default=None, metavar="JSON|PATH", help=MODEL_CONFIG_HELP)
    @click.option("--inputs", "inputs", multiple=True, metavar="SPEC", help=INPUTS_HELP)
    @click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
                  help="The device the program runs on: its kernels (attention's CUDA kernels) and the tensors it "
                       "makes are that device's; a CUDA program compiles on a machine without a GPU.")
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


def make_config(config_path: Optional[str], stage: Optional[str]):
    """A fxzero.Config from a DeepSpeed JSON file and/or --stage.

    `--stage` replaces the file's zero_optimization.stage before the file is read, so the keys
    that depend on the stage (the persistence threshold applies at stage 3) follow it.
    """
    import json

    from fxzero.config import Config

    if config_path is None:
        return Config() if stage is None else Config(stage=int(stage))
    if stage is None:
        return Config.from_deepspeed(config_path)
    with open(config_path) as f:
        ds = json.load(f)
    if not isinstance(ds, dict):
        raise ValueError(f"{config_path}: a DeepSpeed config is a JSON object, got {type(ds).__name__}")
    zero = dict(ds.get("zero_optimization") or {})
    zero["stage"] = int(stage)
    return Config.from_deepspeed({**ds, "zero_optimization": zero})


def static_cost_model(config):
    """The cost model passes may consult when compiling without ranks.

    A preset named in the config is used as is; "measure" (the runtime's default: time the
    machine's collectives at start-up) cannot be done without ranks, so the native collectives
    are kept. `fxzero train` records the choices the runtime made.
    """
    spec = getattr(config, "cost_model", None)
    if isinstance(spec, str):
        if spec == "measure":
            return None
        from fxzero import cost

        return cost.preset(spec)
    return spec


def _si(x: float, unit: str) -> str:
    """360e9, "B/s" -> '360 GB/s' (decimal prefixes, as hardware is specified)."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def describe_hardware(cost_model) -> str:
    """A `fxzero.cost.CostModel` in words: what it stands for, then its figures."""
    from fxzero.viz.fmt import human_seconds

    links = {kind: f"{_si(link.bandwidth, 'B/s')} + {human_seconds(link.latency)}"
             for kind, link in cost_model.links.items()}
    if len(set(links.values())) == 1:
        links = {"collectives": next(iter(links.values()))}
    figures = [_si(cost_model.flops_per_s, "FLOP/s"), f"memory {_si(cost_model.mem_bytes_per_s, 'B/s')}",
               f"{human_seconds(cost_model.op_overhead_s)} per op", *(f"{k} {v}" for k, v in links.items())]
    if cost_model.world_size:
        figures.append(f"over {cost_model.world_size} ranks")
    described = HARDWARE_DESCRIPTIONS.get(cost_model.name)
    return (f"{described}; " if described else "") + ", ".join(figures)


@dataclasses.dataclass
class Compiled:
    artifacts: Artifacts
    seconds: float


def compile_source(spec: str, *, world: Optional[int], stage: Optional[str], config_path: Optional[str],
                   inputs: Sequence[str], model_config: Optional[str] = None, device: str = "cpu") -> Compiled:
    """Build MODEL on the meta device, trace and schedule it, record the artifacts (in memory).

    The model is called as the --inputs spec says (`model(*args, **kwargs)`), or on its own
    example inputs, or on a Hugging Face model's default ones; what fxzero adds is said on stderr.
    """
    import fxzero

    with reports_errors():
        model_spec = parse_model(spec)
        call_spec = parse_call(inputs)
        config = make_config(config_path, stage)
        model = build_model(model_spec, model_config=model_config)
        call = example_call(model, call_spec, what=f"MODEL {spec!r}")
    if call.completed and call_spec.empty:
        click.echo(f"note: no --inputs; tracing {spec} on '{call.spec}'", err=True)
    elif call.completed:
        added = " ".join(str(CallSpec(kwargs=(kv,))) for kv in call.spec.kwargs if kv not in call_spec.kwargs)
        click.echo(f"note: tracing {spec} with {added} too (a KV cache is of no use to training; "
                   "--inputs can say otherwise)", err=True)
    from fxzero.config.effects import ineffective_settings, warn_ineffective

    warn_ineffective(ineffective_settings(config, world_size=world or DEFAULT_WORLD, cuda=False,
                                          initialized_from_seed=True))
    with reports_errors(f"compiling {spec}"):
        start = time.perf_counter()
        compiled = fxzero.compile_program(model, call.args, config, world_size=world or DEFAULT_WORLD,
                                          cost_model=static_cost_model(config), kwargs=call.kwargs, device=device)
        seconds = time.perf_counter() - start
        art = record(compiled, model=spec, inputs=call.spec, config=config, seconds=seconds,
                     model_config=config_record(model))
    return Compiled(art, seconds)


def _looks_like_path(source: str) -> bool:
    return os.path.exists(source) or (":" not in source and (os.sep in source or source.endswith(".json")))


def load_source(source: str, *, world: Optional[int] = None, stage: Optional[str] = None,
                config_path: Optional[str] = None, inputs: Sequence[str] = (),
                model_config: Optional[str] = None, device: str = "cpu") -> Artifacts:
    """Artifacts from a directory written by `fxzero compile`, or compiled now from a MODEL."""
    if _looks_like_path(source):
        with reports_errors():
            art = Artifacts.read(source)
        given = [name for name, v in (("--world", world), ("--stage", stage), ("--config", config_path),
                                      ("--model-config", model_config), ("--inputs", inputs),
                                      ("--device", device if device != "cpu" else None)) if v]
        if given:
            click.echo(f"note: {', '.join(given)} apply when tracing a MODEL; {source} was compiled "
                       f"for ZeRO-{art.schedule.stage} on {art.schedule.world_size} {art.schedule.device} ranks",
                       err=True)
        return art
    return compile_source(source, world=world, stage=stage, config_path=config_path, inputs=inputs,
                          model_config=model_config, device=device).artifacts


def slug(spec: str) -> str:
    """A directory name for a MODEL spec: 'gpt-tiny(n_blocks=2)' -> 'gpt-tiny_n_blocks_2'."""
    base = spec.rsplit("/", 1)[-1].replace(".py:", "-")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", base).strip("_") or "model"
