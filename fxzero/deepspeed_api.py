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
from fxzero.config import Adagrad, Adam, AdamW, Config, OptimizerPolicy
from fxzero.runtime.dataloader import ShardedDataLoader
from fxzero.runtime.engine import Engine

__all__ = ["add_config_arguments", "init_distributed", "initialize"]

_TORCH_OPTIMIZER_DEFAULTS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                             "differentiable": False, "fused": None, "decoupled_weight_decay": None}
"""Options of torch.optim.Adam/AdamW/Adagrad that fxzero's update honours only at these values."""


def init_distributed(dist_backend: Optional[str] = None, *, timeout: Optional[datetime.timedelta] = None,
                     init_method: Optional[str] = None, rank: int = -1, world_size: int = -1,
                     **ignored: Any) -> None:
    """Join the process group the launcher (torchrun) set up. A world of one gets a process group
    of one (in-process, no port), as under DeepSpeed, so a script's own `get_rank()` works; fxzero's
    collectives skip it.

    Args:
        dist_backend: "gloo" or "nccl"; None: nccl with CUDA, else gloo.
        timeout, init_method, rank, world_size: as `torch.distributed.init_process_group`
            (rank and world_size default to the launcher's RANK and WORLD_SIZE).
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
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if world <= 1 and init_method is None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return
    kwargs: dict[str, Any] = {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if rank >= 0:
        kwargs.update(rank=rank, world_size=world)
    dist.init_process_group(backend, init_method=init_method, **kwargs)


def _read_config(args: Any, config: Any, config_params: Any) -> tuple[Config, bool]:
    """The Config, and whether it names an optimizer (a DeepSpeed "optimizer" section)."""
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        raise ValueError("fxzero.initialize needs a config: config=\"ds_config.json\", a dict, or a fxzero.Config "
                         "(or args.deepspeed_config)")
    if isinstance(config, Config):
        return config, False  # (an optimizer passed replaces its default AdamW)
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise TypeError(f"config must be a DeepSpeed dict, a JSON file's path or a fxzero.Config, got "
                        f"{type(config).__name__}")
    return Config.from_deepspeed(config), "optimizer" in config


def _from_torch_optimizer(optimizer: torch.optim.Optimizer) -> tuple[OptimizerPolicy, list[dict]]:
    """A torch AdamW/Adam/Adagrad as fxzero's policy and the param groups it was built with."""
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam, torch.optim.Adagrad):
        raise TypeError(
            f"optimizer is a {type(optimizer).__name__}: fxzero's sharded update runs AdamW, Adam and Adagrad; "
            "pass torch.optim.AdamW/Adam/Adagrad (its param groups and hyperparameters are read), or name the "
            "optimizer in the config")
    d = optimizer.defaults
    for option, default in _TORCH_OPTIMIZER_DEFAULTS.items():
        for group in [d, *optimizer.param_groups]:
            value = group.get(option, default)
            if value not in (default, False) and not (option == "decoupled_weight_decay"
                                                      and isinstance(optimizer, torch.optim.AdamW)):
                raise ValueError(f"optimizer: {option}={value!r} is not supported by fxzero's update; "
                                 f"leave it at {default!r}")
    if isinstance(optimizer, torch.optim.Adagrad):
        # torch fills every group's sum from the constructor's value, never a group's own: so does fxzero.
        initial = float(d["initial_accumulator_value"])
        if any(float(g.get("initial_accumulator_value", initial)) != initial for g in optimizer.param_groups):
            raise ValueError("optimizer: a param group sets its own initial_accumulator_value, which "
                             "torch.optim.Adagrad ignores (every sum starts from the constructor's value); give it "
                             "to the constructor only")
        policy: OptimizerPolicy = Adagrad(lr=float(d["lr"]), lr_decay=float(d["lr_decay"]),
                                          weight_decay=float(d["weight_decay"]), initial_accumulator_value=initial,
                                          eps=float(d["eps"]))
    else:
        decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(d.get("decoupled_weight_decay"))
        policy = (AdamW if decoupled else Adam)(lr=float(d["lr"]), betas=tuple(d["betas"]), eps=float(d["eps"]),
                                                weight_decay=float(d["weight_decay"]))
    groups = [{"params": list(g["params"]),
               **{k: g[k] for k in policy.HYPERPARAMETERS if g[k] != d[k]}}
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
        optimizer: None (the config's "optimizer"), a torch.optim.AdamW/Adam/Adagrad built on the model's
            parameters, or a callable taking the parameters and returning one.
        model_parameters: the parameters or param groups (dicts with "params" and options).
        training_data: a torch Dataset: the returned dataloader yields this rank's micro-batches.
        lr_scheduler: None (the config's "scheduler"), or a callable taking the optimizer and
            returning a scheduler (a torch.optim.lr_scheduler one, say) the engine steps.
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
    cfg, names_optimizer = _read_config(args, config, config_params)
    if optimizer is not None:
        if names_optimizer:
            raise ValueError("an optimizer is passed and the config has an \"optimizer\" section: give one of them")
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(model_parameters if model_parameters is not None else model.parameters())
        policy, model_parameters = _from_torch_optimizer(optimizer)
        cfg = dataclasses.replace(cfg, optimizer=policy)
    if lr_scheduler is not None and cfg.lr_schedule is not None:
        raise ValueError("an lr_scheduler is passed and the config has a \"scheduler\" section: give one of them")
    init_distributed()
    engine = compile_engine(model, cfg, model_parameters=model_parameters)
    scheduler = engine.lr_scheduler  # the config's schedule, built by compile
    if lr_scheduler is not None:
        if not callable(lr_scheduler) or hasattr(lr_scheduler, "step"):
            raise TypeError("lr_scheduler must be a callable taking the engine's optimizer (its param groups are "
                            "what fxzero updates), e.g. lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10)")
        scheduler = lr_scheduler(engine.optimizer)
    engine.lr_scheduler = scheduler
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
