"""Replaying a random operator: the generator state it drew from, and the draw again from it.

[Note: replaying random operators]
A recomputed dropout must draw the mask the forward drew, or the recomputed step is a different
step. As `torch.utils.checkpoint` does, the program keeps the generator's state from just
before the forward's draw (`rng_state`: a node right before the random operator, reading the
same inputs, so the schedule's priority order runs it immediately before the draw: see
`fxzero/schedule/build.py`), and the backward draws again from that state (`replay`), putting
the generator back where it was afterwards: the stream of draws the rest of the step sees is
the resident run's, and the recomputed mask is the forward's, bit for bit. A state is 5056
bytes on the CPU generator and 16 on a CUDA one (its seed and offset), against a mask's four
bytes per element.

Both are plain functions the runtime calls like any operator (`fxzero/runtime/executor.py`);
on fake or meta tensors (a dry run, tracing) no generator is touched.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["STATE_BYTES", "replay", "rng_state"]

STATE_BYTES = {"cpu": 5056, "cuda": 16}
"""Bytes of a generator state by device type (`torch.get_rng_state`, `torch.cuda.get_rng_state`)."""


def _device(args: Any) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (list, tuple)):
            found = _device(a)
            if found.type != "cpu":
                return found
    return torch.device("cpu")


def _is_fake(args: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(a, FakeTensor) or (isinstance(a, torch.Tensor) and a.device.type == "meta") for a in args)


def _get(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def rng_state(*inputs: Any, device: Any = None) -> torch.Tensor:
    """The state of the generator that a random operator reading `inputs` draws from, now
    (`device`: the operator's own device argument, for one that reads no tensor)."""
    has_tensor = any(isinstance(a, torch.Tensor) for a in inputs)
    device = _device(inputs) if has_tensor or device is None else torch.device(device)
    if _is_fake(inputs):
        return torch.empty(STATE_BYTES.get(device.type, 16), dtype=torch.uint8)
    return _get(device).clone()


def replay(state: torch.Tensor, op: Callable, *args: Any, **kwargs: Any) -> Any:
    """`op(*args, **kwargs)` drawn from `state`; the generator is left where it was."""
    if _is_fake(args):
        return op(*args, **kwargs)
    device = _device(args)
    now = _get(device)
    _set(device, state)
    try:
        return op(*args, **kwargs)
    finally:
        _set(device, now)
