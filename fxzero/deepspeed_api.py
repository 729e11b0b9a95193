"""DeepSpeed's entry points on fxzero: `init_distributed`, `initialize`, `add_config_arguments`.

    import fxzero as deepspeed
    deepspeed.init_distributed()
    engine, optimizer, dataloader, lr_scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), training_data=dataset, config="ds_config.json")

`initialize` returns what DeepSpeed's does, in DeepSpeed's order: the engine (`fxzero.compile`'s),
the optimizer whose param_groups a schedule writes, a dataloader of this rank's micro-batches
(None without training_data) and the LR scheduler (None without one). The config is a
DeepSpeed dict or JSON path, read strictly (`fxzero/config/deepspeed.py`), or a `fxzero.Config`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from fxzero.api import compile as compile_engine
from fxzero.config import OPTIMIZERS, Adagrad, Adam, AdamW, Config, OptimizerPolicy
from fxzero.config.notices import warn_ineffective
from fxzero.runtime.device import process_group_backend
from fxzero.runtime.dataloader import ShardedDataLoader
from fxzero.runtime.deepspeed_optimizers import DeepSpeedOptimizerObject
from fxzero.runtime.engine import Engine

__all__ = ["add_config_arguments", "init_distributed", "initialize"]

_TORCH_OPTIMIZER_DEFAULTS = {"maximize": False, "capturable": False, "differentiable": False, "fused": None}
"""Options of torch.optim's optimizers that fxzero's update honours only at these values: how torch
computes (capturable, differentiable; fused, except where the policy runs torch's fused kernel
itself: `AdamW.fused`) and maximize. `foreach` is read as any value: torch's foreach and
for-loop paths do the same arithmetic per element, which is fxzero's."""

_POLICY_OF_TORCH: dict[type, type[OptimizerPolicy]] = {
    getattr(torch.optim, cls.TORCH): cls for cls in OPTIMIZERS if cls.TORCH is not None}
"""The torch.optim class each element-wise policy reproduces (torch.optim.Adam with
decoupled_weight_decay=True: `AdamW`)."""

_WHOLE_TENSOR_OPTIMIZERS = {
    "LBFGS": "it keeps curvature pairs of the whole parameter vector and re-evaluates the loss in a line search",
    "SparseAdam": "it takes sparse gradients (nn.Embedding(sparse=True)), and fxzero's gradients are dense shards",
    "Adafactor": "it factors each matrix's second moment into row and column means",
    "Muon": "it orthogonalizes each matrix's update (Newton-Schulz iterations on the whole 2-D gradient)",
    "LARS": "its trust ratio divides each parameter's norm by its gradient's norm",
}
"""Optimizers that need each parameter whole, and why (by class name, torch's or other libraries')."""

_LAMB_OBJECTS = ("Lamb", "LAMB", "FusedLamb", "FusedLAMB", "OnebitLamb")
"""LAMB optimizers of other libraries (DeepSpeed's, apex's, torch-optimizer's), by class name:
fxzero runs LAMB as DeepSpeed's FusedLamb computes it (`fxzero.Lamb`), named in the config; these
objects' formulas differ (where bias correction and weight decay enter, the ratio's clamp), so
their settings are not read into it."""


def init_distributed(dist_backend: Optional[str] = None, *, timeout: Optional[datetime.timedelta] = None,
                     init_method: Optional[str] = None, rank: int = -1, world_size: int = -1,
                     **ignored: Any) -> None:
    """Join the process group the launcher (torchrun) set up. A world of one gets a process group
    of one (in-process, no port), as under DeepSpeed, so a script's own `get_rank()` works; fxzero's
    collectives skip it.

    Args:
        dist_backend: "gloo" or "nccl" (with CUDA, NCCL for device tensors and gloo for host
            tensors); None: that with CUDA, else gloo.
        timeout: as `torch.distributed.init_process_group`'s.
        init_method: as `torch.distributed.init_process_group`'s.
        rank: as `torch.distributed.init_process_group`'s; default: the launcher's RANK.
        world_size: as `torch.distributed.init_process_group`'s; default: the launcher's WORLD_SIZE.
        ignored: DeepSpeed's MPI-discovery options (auto_mpi_discovery, distributed_port,
            verbose, dist_init_required, config), which torchrun makes moot.
    """
    unknown = sorted(set(ignored) - {"auto_mpi_discovery", "distributed_port", "verbose", "dist_init_required",
                                     "config"})
    if unknown:
        raise TypeError(f"init_distributed() got unexpected keyword arguments {unknown}")
    if dist.is_initialized():
        return
    world = world_size if world_size > 0 else int(os.environ.get("WORLD_SIZE", "1"))
    backend = dist_backend or process_group_backend()  # (NCCL with gloo beside it on CUDA ranks)
    if backend == "nccl" and torch.cuda.is_available():  # (accelerate names "nccl": gloo beside it carries host
        backend = process_group_backend()  # tensors, such as a model gathered before initialize, in host memory)
    if world <= 1 and init_method is None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return
    kwargs: dict[str, Any] = {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if rank >= 0:
        kwargs.update(rank=rank, world_size=world)
    dist.init_process_group(backend, init_method=init_method, **kwargs)


def _read_config(args: Any, config: Any, config_params: Any,
                 client_optimizer: bool = False) -> tuple[Config, bool, Optional[int]]:
    """The Config; whether it names an optimizer (a DeepSpeed "optimizer" section with a type);
    the ZeRO stage a DeepSpeed config asks for (0, DeepSpeed's default, runs as stage 1; None for
    a fxzero.Config). `client_optimizer`: initialize was given an optimizer."""
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        raise ValueError("fxzero.initialize needs a config: config=\"ds_config.json\", a dict, or a fxzero.Config "
                         "(or args.deepspeed_config)")
    if isinstance(config, Config):
        return config, False, None  # (an optimizer passed replaces its default AdamW)
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise TypeError(f"config must be a DeepSpeed dict, a JSON file's path or a fxzero.Config, got "
                        f"{type(config).__name__}")
    if config.get("scheduler") and not (config.get("optimizer") or {}).get("type") and not client_optimizer:
        # DeepSpeed builds a schedule only with an optimizer: with neither, its section is never read
        # (Hugging Face's Trainer evaluating alone keeps a training config's, its steps set to 0).
        warn_ineffective(['the DeepSpeed config\'s "scheduler" section has no effect: no optimizer is configured '
                          '(no "optimizer" section, none passed to initialize), and DeepSpeed steps a schedule only '
                          "with one (and neither trains without one)"])
        config = {k: v for k, v in config.items() if k != "scheduler"}
    cfg = Config.from_deepspeed(config)
    asked = (config.get("zero_optimization") or {}).get("stage", 0)
    return cfg, bool((config.get("optimizer") or {}).get("type")), int(asked) if isinstance(asked, int) else None


def _from_torch_optimizer(optimizer: torch.optim.Optimizer) -> tuple[OptimizerPolicy, list[dict]]:
    """A client's element-wise torch optimizer as fxzero's policy (its constructor's options, read
    from `defaults`) and the param groups it was built with.

    Raises:
        TypeError: an optimizer fxzero cannot run on shards (one that needs each parameter whole,
            a subclass or another library's, whose step() may compute anything).
        ValueError: an option fxzero's update does not honour, or groups that disagree where torch
            reads the constructor's value.
    """
    name = type(optimizer).__name__
    cls = _POLICY_OF_TORCH.get(type(optimizer))
    if isinstance(optimizer, DeepSpeedOptimizerObject):  # (DeepSpeed's own classes: options to read, as torch's)
        cls = optimizer.policy_class()
    runs = ", ".join(f"torch.optim.{c.TORCH}" for c in OPTIMIZERS if c.TORCH is not None)
    if cls is None and name in _LAMB_OBJECTS:
        raise TypeError(f"optimizer is a {name}: fxzero runs LAMB as DeepSpeed's FusedLamb computes it, each "
                        "parameter's norms summed from the shards, when the config names it (\"optimizer\": "
                        "{\"type\": \"Lamb\", \"params\": {...}}, or Config(optimizer=fxzero.Lamb(...))); a LAMB "
                        "object of another library is not read, since its formulas differ (where the bias correction "
                        "and weight decay enter, the trust ratio's clamp): drop optimizer= and name it in the config")
    if cls is None and name in _WHOLE_TENSOR_OPTIMIZERS:
        raise TypeError(f"optimizer is a {name}: it needs each parameter whole ({_WHOLE_TENSOR_OPTIMIZERS[name]}), and "
                        "each rank holds a flat shard of its units, pieces of several parameters and most of none; use "
                        f"an element-wise optimizer ({runs}, or fxzero.Lion in the config)")
    if cls is None:
        raise TypeError(f"optimizer is a {name}: fxzero runs the element-wise torch.optim optimizers on its shards "
                        f"({runs}; a subclass or another library's optimizer may compute anything in its step()); pass "
                        "one of them (its param groups and hyperparameters are read), or name the optimizer in the "
                        "config (\"Lion\" too)")
    d = optimizer.defaults
    fields_of = {f.name for f in dataclasses.fields(cls)}
    for option, default in _TORCH_OPTIMIZER_DEFAULTS.items():
        if option in fields_of:  # (the policy runs it: AdamW.fused)
            continue
        for group in [d, *optimizer.param_groups]:
            value = group.get(option, default)
            if value not in (default, False):
                raise ValueError(f"optimizer: {option}={value!r} is not supported by fxzero's update; "
                                 f"leave it at {default!r}")
    for i, group in enumerate(optimizer.param_groups):
        tensors = sorted(k for k, v in group.items() if k != "params" and isinstance(v, torch.Tensor))
        if tensors:
            raise ValueError(f"optimizer: param group {i} holds {tensors} as tensors; fxzero's update reads Python "
                             "numbers: give floats")
    if cls is Adam and d.get("decoupled_weight_decay"):
        cls = AdamW
    for option in ("decoupled_weight_decay", "initial_accumulator_value"):
        # (torch.optim.Adam reads the first per group, yet fxzero's Adam/AdamW decide it for all;
        # torch.optim.Adagrad fills every group's sum from the constructor's value, never a group's own.)
        if cls in (Adam, AdamW, Adagrad) and any(g.get(option, d.get(option)) != d.get(option)
                                                for g in optimizer.param_groups):
            raise ValueError(f"optimizer: a param group sets its own {option}, unlike the optimizer's "
                             f"{d.get(option)!r}; fxzero's {cls.__name__} takes it from the constructor only: give it "
                             "to the constructor")
    fields = {}
    for f in dataclasses.fields(cls):
        if f.name in d:
            value = d[f.name]
            fields[f.name] = tuple(float(x) for x in value) if isinstance(value, (list, tuple)) else (
                bool(value) if isinstance(f.default, bool) else float(value))
    policy = cls(**fields)
    groups = [{"params": list(g["params"]),
               **{k: g[k] for k in policy.HYPERPARAMETERS if k in g and g[k] != d.get(k)}}
              for g in optimizer.param_groups]
    return policy, groups


def initialize(args: Any = None, model: Optional[nn.Module] = None, optimizer: Any = None,
               model_parameters: Optional[Iterable[Any]] = None, training_data: Any = None,
               lr_scheduler: Any = None, distributed_port: Optional[int] = None, mpu: Any = None,
               dist_init_required: Optional[bool] = None, collate_fn: Optional[Callable] = None,
               config: Union[str, os.PathLike, dict, Config, None] = None, mesh_param: Any = None,
               config_params: Any = None) -> tuple[Engine, Any, Optional[ShardedDataLoader], Any]:
    """DeepSpeed's `initialize`: (engine, optimizer, training dataloader, lr scheduler).

    Args:
        model: the module (built eagerly or on the meta device).
        optimizer: None (the config's "optimizer"), an element-wise torch optimizer (torch.optim.AdamW,
            Adam, SGD, RMSprop, ...: `_from_torch_optimizer`) built on the model's parameters, or a
            callable taking the parameters and returning one. Its param group dicts become the
            engine optimizer's ([Note: a client's optimizer and scheduler] in runtime/optimizer.py).
        model_parameters: the parameters or param groups (dicts with "params" and options); a
            trainable parameter in none is not trained ([Note: parameters in no group]).
        training_data: a torch Dataset: the returned dataloader yields this rank's micro-batches.
        lr_scheduler: None (the config's "scheduler"), a scheduler built on `optimizer` (a
            torch.optim.lr_scheduler one, say: pointed at the engine's optimizer), or a callable
            taking the engine's optimizer and returning one; the engine steps it after each
            optimizer step.
        config: the DeepSpeed config (path or dict) or a fxzero.Config; `config_params` and
            `args.deepspeed_config` are read where it is None, as DeepSpeed does.
    """
    if model is None:
        raise ValueError("fxzero.initialize needs model=")
    if mpu is not None or mesh_param is not None:
        raise ValueError("fxzero is data parallel only: mpu (model parallelism) and mesh_param are not supported")
    if config is None and config_params is None and getattr(args, "deepspeed_config", None) is None:
        record = getattr(model, "_fxzero_zero_init", None)  # the config zero.Init was given
        config = record.config if record is not None else None
    cfg, names_optimizer, asked_stage = _read_config(args, config, config_params, client_optimizer=optimizer is not None)
    client: Optional[torch.optim.Optimizer] = None  # the client's torch optimizer, once built
    if optimizer is not None:
        if names_optimizer:  # (DeepSpeed uses the client's, and reads the section for nothing)
            warn_ineffective(["the DeepSpeed config's \"optimizer\" section has no effect: an optimizer was passed to "
                              "initialize, and it is the one trained with, as under DeepSpeed; drop one of them"])
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(model_parameters if model_parameters is not None else model.parameters())
        policy, model_parameters = _from_torch_optimizer(optimizer)
        cfg = dataclasses.replace(cfg, optimizer=policy)
        client = optimizer
    if lr_scheduler is not None and cfg.lr_schedule is not None:  # (DeepSpeed: the client's, too)
        warn_ineffective(["the DeepSpeed config's \"scheduler\" section has no effect: an lr_scheduler was passed to "
                          "initialize, and it is the one stepped, as under DeepSpeed; drop one of them"])
        cfg = dataclasses.replace(cfg, lr_schedule=None)
    init_distributed()
    engine = compile_engine(model, cfg, model_parameters=model_parameters)
    if client is not None:  # one set of param group dicts ([Note: a client's optimizer and scheduler])
        engine.optimizer.share_groups(client)
    scheduler = engine.lr_scheduler  # the config's schedule, built by compile
    if lr_scheduler is not None:
        if hasattr(lr_scheduler, "step"):  # a scheduler object: DeepSpeed uses it as given, stepping it
            scheduler = engine.optimizer.adopt_scheduler(lr_scheduler, client)
        elif callable(lr_scheduler):
            scheduler = lr_scheduler(engine.optimizer)
            engine.optimizer.check_groups()  # (what the scheduler set, such as a momentum, within the states kept)
        else:
            raise TypeError(f"lr_scheduler is a {type(lr_scheduler).__name__}: give a scheduler built on the "
                            "optimizer you pass (StepLR(opt, 10)), or a callable taking the engine's optimizer "
                            "(lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10))")
    engine.lr_scheduler = scheduler
    if asked_stage is not None and not names_optimizer and optimizer is None:
        # (DeepSpeed builds no optimizer then, and its backward asserts "must provide optimizer during
        # init in order to use backward"; training with fxzero's default AdamW would be a choice nobody made)
        engine.without_optimizer = ('no optimizer was configured: the DeepSpeed config has no "optimizer" section '
                                    "with a type and initialize was given none, so there is nothing to train with "
                                    "(DeepSpeed refuses too); add one to the config (\"optimizer\": {\"type\": "
                                    "\"AdamW\", \"params\": {\"lr\": ...}}) or pass optimizer= to initialize. "
                                    "Forwards (evaluation) run without one")
    if asked_stage == 0:
        engine.deepspeed_stage = 0  # (run as stage 1: what zero_optimization_stage() reports, as DeepSpeed's)
    loader = None
    if training_data is not None:
        loader = ShardedDataLoader(training_data, batch_size=engine.train_micro_batch_size_per_gpu(),
                                   rank=engine.rank, world_size=engine.world_size, collate_fn=collate_fn,
                                   drop_last=cfg.dataloader_drop_last, seed=cfg.seed)
        engine.training_dataloader = loader  # (its position is saved in checkpoints)
    return engine, engine.optimizer, loader, scheduler


def add_config_arguments(parser):
    """DeepSpeed's command-line arguments, added to an argparse parser (`deepspeed.add_config_arguments`):
    `--deepspeed` (a flag scripts test), `--deepspeed_config PATH` (read by `initialize(args=...)`),
    and the deprecated `--deepscale` / `--deepscale_config`. Returns the parser."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated DeepSpeed json configuration file.")
    return parser
