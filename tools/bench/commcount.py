"""Count what torch.distributed collectives move, in the rank processes, for any system.

`install()` wraps every tensor collective of `torch.distributed` (both the names it exports and
the module-level functions of `distributed_c10d`, which torch's own helpers call), so FSDP2,
DeepSpeed (whose `deepspeed.comm` calls torch.distributed) and fxzero's runtime are all seen.
It must run before those libraries bind any function (DeepSpeed's TorchBackend keeps a reference
to `all_gather_into_tensor` when it is created), so each rank installs it first.

What is not seen: collectives issued from C++. DDP's Reducer all-reduces its gradient buckets in
C++, so the DDP runner registers a comm hook that counts each bucket and then runs torch's
default `allreduce_hook` (see `ddp.py`).

[Note: what one element of traffic means]
For each call we record the size of the collective's full buffer, the same convention as
`fxzero.Engine.comm_report()`: an all-gather counts its output (all ranks' shards), a
reduce-scatter its input (the full unreduced buffer), an all-reduce or broadcast its tensor.
Under that convention ZeRO-3 moves 3 Phi elements per step (two all-gathers, one reduce-scatter)
and DDP Phi (one all-reduce). The ZeRO paper counts an all-reduce as a reduce-scatter plus an
all-gather, so 2 Phi for DDP; `volume_elements` applies that weight of 2 to all-reduces, which
makes systems comparable in what a ring actually sends: on N ranks each rank sends (N-1)/N of
`volume_elements` times the element size. The loopback counter in `common.loopback_bytes` is an
independent check of what gloo really put on the wire.
"""

from __future__ import annotations

import collections
import functools
import threading
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["CommCounter", "COUNTED_BY", "install"]

COUNTED_BY = (
    "torch.distributed collectives wrapped in each rank (tools/bench/commcount.py); elements = "
    "size of each collective's full buffer (all-gather output, reduce-scatter input, all-reduce "
    "tensor), as fxzero's comm_report counts; volume_elements weighs all-reduce x2 (ZeRO paper)"
)


def _numel(obj: Any) -> tuple[int, int]:
    """(elements, bytes) of a tensor or a (nested) list of tensors."""
    if isinstance(obj, torch.Tensor):
        return obj.numel(), obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        n = b = 0
        for item in obj:
            dn, db = _numel(item)
            n, b = n + dn, b + db
        return n, b
    return 0, 0


def _arg(args: tuple, kwargs: dict, index: int, *names: str) -> Any:
    if len(args) > index:
        return args[index]
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return None


# op name -> (kind it is reported as, which argument holds the full buffer: (position, names)).
_OPS: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "all_reduce": ("all_reduce", 0, ("tensor",)),
    "all_reduce_coalesced": ("all_reduce", 0, ("tensors",)),
    "broadcast": ("broadcast", 0, ("tensor",)),
    "reduce": ("reduce", 0, ("tensor",)),
    "all_gather": ("all_gather", 0, ("tensor_list",)),
    "all_gather_single": ("all_gather", 0, ("output_tensor",)),
    "all_gather_into_tensor": ("all_gather", 0, ("output_tensor",)),
    "_all_gather_base": ("all_gather", 0, ("output_tensor",)),
    "all_gather_coalesced": ("all_gather", 0, ("output_tensor_lists",)),
    "reduce_scatter": ("reduce_scatter", 1, ("input_list",)),
    "reduce_scatter_single": ("reduce_scatter", 1, ("input",)),
    "reduce_scatter_tensor": ("reduce_scatter", 1, ("input",)),
    "_reduce_scatter_base": ("reduce_scatter", 1, ("input",)),
    "all_to_all_single": ("all_to_all", 1, ("input",)),
    "all_to_all": ("all_to_all", 1, ("input_tensor_list",)),
    "gather": ("gather", 0, ("tensor",)),
    "scatter": ("scatter", 0, ("tensor",)),
    "send": ("send", 0, ("tensor",)),
    "isend": ("send", 0, ("tensor",)),
    "recv": ("recv", 0, ("tensor",)),
    "irecv": ("recv", 0, ("tensor",)),
    "barrier": ("barrier", -1, ()),
}

# Weight of each kind in volume_elements; see [Note: what one element of traffic means].
_VOLUME_WEIGHT = {"all_reduce": 2}
# Kinds that are point-to-point or control: reported, but not part of the collective volume.
_NOT_VOLUME = {"barrier", "send", "recv"}


class CommCounter:
    """Calls, elements and bytes per collective kind, counted while `enabled`."""

    def __init__(self) -> None:
        self.enabled = False
        self._local = threading.local()  # call depth: count only the outermost collective
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.traffic: dict[str, dict[str, int]] = collections.defaultdict(
                lambda: {"calls": 0, "elements": 0, "bytes": 0}
            )

    def add(self, kind: str, buffer: Any) -> None:
        if not self.enabled:
            return
        n, b = _numel(buffer)
        with self._lock:
            t = self.traffic[kind]
            t["calls"] += 1
            t["elements"] += n
            t["bytes"] += b

    def counted(self, kind: str, buffer: Any) -> "_Outermost":
        """Context manager: count `buffer` as one `kind` call unless already inside a counted call."""
        return _Outermost(self, kind, buffer)

    def report(self, steps: int) -> dict[str, Any]:
        """Per-step averages over `steps` steps, by kind, with the totals."""
        with self._lock:
            by_kind = {
                k: {f: v / steps for f, v in t.items()} for k, t in sorted(self.traffic.items())
            }
        elements = sum(t["elements"] for k, t in by_kind.items() if k not in _NOT_VOLUME)
        volume = sum(
            t["elements"] * _VOLUME_WEIGHT.get(k, 1) for k, t in by_kind.items() if k not in _NOT_VOLUME
        )
        nbytes = sum(t["bytes"] for k, t in by_kind.items() if k not in _NOT_VOLUME)
        return {
            "by_kind": by_kind,
            "elements": elements,
            "bytes": nbytes,
            "volume_elements": volume,
        }


class _Outermost:
    def __init__(self, counter: CommCounter, kind: str, buffer: Any) -> None:
        self.counter, self.kind, self.buffer = counter, kind, buffer

    def __enter__(self) -> None:
        local = self.counter._local
        depth = getattr(local, "depth", 0)
        if depth == 0:
            self.counter.add(self.kind, self.buffer)
        local.depth = depth + 1

    def __exit__(self, *exc) -> None:
        self.counter._local.depth -= 1


def _wrap(counter: CommCounter, name: str, fn: Callable) -> Callable:
    kind, index, names = _OPS[name]

    @functools.wraps(fn)
    def counted(*args, **kwargs):
        buffer = None if index < 0 else _arg(args, kwargs, index, *names)
        with counter.counted(kind, buffer):
            return fn(*args, **kwargs)

    counted.__wrapped_by_bench__ = True  # type: ignore[attr-defined]
    return counted


def install(counter: CommCounter, modules: Iterable[Any] = (dist, c10d)) -> list[str]:
    """Wrap every collective in `modules` so that `counter` sees it; returns the names wrapped."""
    wrapped = []
    for name in _OPS:
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "__wrapped_by_bench__", False):
            continue
        replacement = _wrap(counter, name, original)
        for module in modules:
            if getattr(module, name, None) is original:
                setattr(module, name, replacement)
        wrapped.append(name)
    return wrapped
