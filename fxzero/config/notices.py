"""Warnings said once per process: settings that change nothing, settings that are slow, and
what a DeepSpeed config's "auto" values became.

A setting a user chose that changes nothing is a silent surprise: it is named in a
`warnings.warn` with the reason and the way out, once per process.
"""

from __future__ import annotations

import os
import warnings

__all__ = ["IneffectiveSetting", "SlowSetting", "print_once", "warn_ineffective", "warn_once"]

_WARNED: set[str] = set()
_PRINTED: set[str] = set()


class IneffectiveSetting(UserWarning):
    """A setting that has no effect in the configuration it appears in."""


class SlowSetting(UserWarning):
    """A setting that works here but is much slower than an alternative that would do.

    On a CPU-only machine: float16 compute (mixed precision or autocast), whose matmuls have no
    fast CPU kernel; bfloat16 compute on an x86 CPU without AVX-512, where bfloat16 matmuls run
    tens of times slower than float32 (`fxzero.config.effects.slow_settings`)."""


def warn_once(messages: list[str], category: type[Warning], stacklevel: int = 3) -> None:
    """Warn once per process for each message."""
    for message in messages:
        if message not in _WARNED:
            _WARNED.add(message)
            warnings.warn(message, category, stacklevel=stacklevel)


def warn_ineffective(messages: list[str], stacklevel: int = 3) -> None:
    """Warn once per process for each message, as an `IneffectiveSetting`."""
    warn_once(messages, IneffectiveSetting, stacklevel=stacklevel + 1)


def print_once(lines: list[str]) -> None:
    """Print each line once per process, on the launcher's rank 0 only (RANK unset: this process)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    for line in lines:
        if line not in _PRINTED:
            _PRINTED.add(line)
            print(f"[fxzero] {line}", flush=True)
