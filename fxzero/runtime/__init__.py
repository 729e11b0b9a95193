"""The runtime: executes a Schedule (executor), collectives (comm), AdamW (optim),
rank-local materialization (materialize, with init_events and init_replay for a model built on
the meta device), and the user-facing Engine (engine)."""

import importlib as _importlib

_ON_ACCESS = ("engine", "lr_schedules")
"""Submodules given on attribute access without an import first: DeepSpeed's `import deepspeed`
leaves `deepspeed.runtime.engine` and `deepspeed.runtime.lr_schedules` loaded, and programs reach
them so (accelerate reads `deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES` after a plain
`import deepspeed`); under fxzero `deepspeed.runtime` is this package (fxzero/deepspeed_alias.py)."""


def __getattr__(name: str):
    if name in _ON_ACCESS:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
