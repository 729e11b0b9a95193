"""`import deepspeed` resolves to fxzero: DeepSpeed programs run unchanged (`fxzero run`).

    fxzero.deepspeed_alias.install()      # from here on, deepspeed.X is fxzero.X in this process
    import deepspeed                      # fxzero itself
    from deepspeed.accelerator import get_accelerator     # fxzero.accelerator.get_accelerator

A finder first on `sys.meta_path` answers every `deepspeed` and `deepspeed.X` import with the
module `fxzero` and `fxzero.X`: the same module objects, never a second copy under the other
name. A DeepSpeed module fxzero does not have is an ImportError naming it and what fxzero has.
`fxzero run` installs it in every process it starts, and puts a `deepspeed` package on
PYTHONPATH that installs it too, so processes a script spawns itself (a test harness's workers)
resolve `deepspeed` the same way.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Optional

__all__ = ["PROVIDED", "install", "installed"]

PROVIDED = ("accelerator", "comm", "zero", "utils", "moe", "moe.utils", "moe.layer")
"""DeepSpeed's modules fxzero provides (as fxzero.<name>), beside the package itself."""


class _Loader(importlib.abc.Loader):
    """Hands the import system an fxzero module already imported, under the deepspeed name."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.spec = module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # (the import system set the alias's spec; the module keeps its own)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path=None, target=None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        rest = fullname[len("deepspeed"):]
        if rest and rest[1:] not in PROVIDED:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: under fxzero, `deepspeed` is fxzero, which provides "
                f"deepspeed.{', deepspeed.'.join(PROVIDED)} and the package's own names (initialize, "
                f"init_distributed, add_config_arguments); {fullname} is a DeepSpeed internal fxzero does not "
                "have", name=fullname)
        module = importlib.import_module("fxzero" + rest)
        return importlib.machinery.ModuleSpec(fullname, _Loader(module), is_package=hasattr(module, "__path__"))


_FINDER = _Finder()


def install() -> None:
    """Make `deepspeed` and `deepspeed.X` resolve to fxzero in this process (idempotent)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    here = sys.modules.get("deepspeed")
    if here is not None and not getattr(here, "__name__", "").startswith("fxzero"):
        for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
            del sys.modules[name]  # (the shim package, or a real DeepSpeed imported before: ours now)
    import fxzero

    sys.modules["deepspeed"] = fxzero


def installed() -> bool:
    return _FINDER in sys.meta_path
