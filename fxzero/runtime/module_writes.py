"""Values the user writes into the module after compile reach what the engine trains.

[Note: writes into the user's module]
The user's parameters view what the engine holds ([Note: the user's module] in
`fxzero/runtime/user_module.py`), but the engine trains its own storage, and three ways of
writing a parameter after compile would otherwise miss it, silently:

- under mixed precision a parameter views the compute-dtype copy: a write into it changed what
  the next forward computed with, and the step then cast the fp32 master over it (DeepSpeed loses
  such writes the same way, at its first step);
- at ZeRO-3 a sharded parameter is a placeholder on the meta device: a write into it does
  nothing (torch's `load_state_dict` only warns: "copying ... to a meta parameter ... is a no-op");
- a tiled parameter is assembled from its tiles: a write reaches the assembled copy only.

So:

- `model.load_state_dict(sd)`, or any submodule's, writes the state dict's values themselves
  into the engine: the fp32 masters exactly (a bf16 or fp32 file's values, as torch's copy into
  an fp32 parameter would give them), the compute-dtype copies cast from them, on whatever tier
  each unit lives, for every stage. Each rank writes its own shard from its own state dict, so no
  rank communicates then, and every rank must load the same values: the next forward's agreement
  (the 8-byte all-gather every forward makes) compares a digest of what each rank wrote, and ranks
  that differ (a state dict loaded on rank 0 only) get an error naming the parameter on every
  rank, as do in-place writes of different values (`announcements`). `strict`, the missing and unexpected keys
  and shape errors are torch's own; `assign=True` keeps the parameter objects (the engine's), as
  it must. The optimizer states stay as they are, as torch's `load_state_dict` leaves them.
- Any other in-place write through the parameter object (`nn.init.*_(p)`, `p.copy_(...)`,
  `p.mul_(...)` under `torch.no_grad()`) bumps the parameter's version counter, which the engine
  reads before each forward and step (`take`, cheap: one integer per parameter) and at the state
  APIs. A written parameter holding a value goes to the master, element by element where it
  differs from the master cast to the compute dtype (so the elements the write did not change
  keep their fp32 precision; those it did hold exactly what was written, which under mixed
  precision is a compute-dtype value). A written placeholder (ZeRO-3) held no value to write
  into: an error names it and the ways that work (`load_state_dict`, `GatheredParameters` with
  `modifier_rank`, `safe_set_full_fp32_param`). A write through `p.data` has a version counter
  of its own and is not seen: at fp32 ZeRO-1/2 it is in the master anyway (the parameter views
  it); elsewhere use one of the ways above.
- A parameter object the engine does not hold (a module replaced or added after compile:
  `model.head = nn.Linear(...)`, a LoRA layer injected) is an error at the next forward or step
  naming it: the programs would compute with the old parameters. So is a buffer registered or
  removed after compile (a forward reading `getattr(self, "mask", None)` would never see it).
- A buffer the user replaces (`module.scale = torch.full(...)`, a non-persistent buffer assigned
  again) has its value copied into the engine's buffer, which the programs read, and the module
  points at the engine's again; a replacement of another shape is an error (the programs were
  compiled for the old one). Before, the programs kept reading the old buffer, and the next
  step's rebinding put it back.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn as nn

from fxzero.schedule.validate import WRITTEN

if TYPE_CHECKING:
    from fxzero.runtime.user_module import UserModule

__all__ = ["EngineHook", "ModuleWrites"]


class EngineHook:
    """A hook the engine registers on the user's modules: calls `method`. torch marks hooks with
    attributes, which a bound method cannot take; and pickling one (`torch.save(model)`, which
    pickles the module with its hooks) is refused naming what to save instead: the module's
    parameters are the engine's views, placeholders at ZeRO-3, so the file would not hold the
    trained model."""

    def __init__(self, method) -> None:
        self.method = method

    def __call__(self, *args: Any) -> Any:
        return self.method(*args)

    def __copy__(self) -> "EngineHook":
        return self  # (as copy treats a function: `copy.deepcopy(model)` works as it did)

    def __deepcopy__(self, memo: dict) -> "EngineHook":
        return self

    def __reduce__(self):
        raise TypeError(
            "torch.save(model) / pickling the model after fxzero.compile: its parameters are views of what the "
            "engine trains (placeholders with no values at ZeRO-3), so the file would not hold the trained model. "
            "Save model.state_dict() (the trained values, gathered at ZeRO-3: call it on every rank), "
            "engine.save_16bit_model(dir), or a checkpoint with engine.save_checkpoint(dir)")


class ModuleWrites:
    """Carries writes into the user's module into the engine ([Note: writes into the user's module])."""

    def __init__(self, user: "UserModule") -> None:
        self.user = user
        self.versions: dict[str, int] = {}  # FQN -> the version counter as the engine last set it
        self._loading: Optional[tuple[int, dict[str, torch.Tensor]]] = None  # (outermost module's id, values)
        self._announced: list[str] = []  # what this rank wrote since the last agreement (`announcements`)
        self._buffers = {fqn for fqn, _ in user.model.named_buffers(remove_duplicate=False)}  # (as built)
        self._hooks = []
        pre, post = EngineHook(self._load_pre_hook), EngineHook(self._load_post_hook)
        for module in user.model.modules():
            self._hooks.append(module.register_load_state_dict_pre_hook(pre))
            self._hooks.append(module.register_load_state_dict_post_hook(post))

    def seen(self, fqn: str) -> None:
        """The engine set this parameter: what it holds now is not a write of the user's."""
        self.versions[fqn] = self.user.params[fqn]._version

    # -- load_state_dict ---------------------------------------------------------------------

    def _load_pre_hook(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
                       missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        if self._loading is None or prefix == "":  # (the outermost call; a stale one from an error is replaced)
            self._loading = (id(module), {})
        user, values = self.user, self._loading[1]
        for name, param in module._parameters.items():
            key = prefix + name
            bound = getattr(param, "_fxzero_binding", None)
            if key not in state_dict or bound is None or bound[0] is not user or user.gathered_now(bound[1]):
                continue  # (inside GatheredParameters torch writes the gathered value, which the block writes back)
            value = state_dict[key]
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(param.shape):
                continue  # (torch reports it)
            values[bound[1]] = value.detach()
            state_dict[key] = param  # (torch copies the parameter onto itself, or with assign=True keeps it)

    def _load_post_hook(self, module: nn.Module, incompatible_keys: Any) -> None:
        if self._loading is None or self._loading[0] != id(module):
            return  # an inner module: the outermost call installs everything once
        values, self._loading = self._loading[1], None
        if values:
            self.install(values, keep_equal=False)

    # -- in-place writes and replaced buffers --------------------------------------------------

    @torch.no_grad()
    def take(self, refuse_lost: bool = True, check_parameters: bool = True) -> None:
        """Carry the user's writes since the engine last set the parameters into the engine
        (before a forward, a step, a state API). `refuse_lost=False` (before a checkpoint's load,
        which replaces them): a write into a placeholder is forgotten, not an error.
        `check_parameters`: refuse parameters the engine does not hold (where it runs programs)."""
        user = self.user
        if check_parameters:
            self._check_parameters()
        user.bind_buffers()  # (a replaced buffer's value into the engine's)
        written = [fqn for fqn, p in user.params.items()
                   if not user.gathered_now(fqn) and p._version != self.versions.get(fqn, p._version)]
        if not written:
            return
        lost = [fqn for fqn in written if user.params[fqn].is_meta]
        if lost:
            for fqn in lost:  # (said once: the engine holds what it held before the write)
                self.seen(fqn)
            written = [fqn for fqn in written if fqn not in lost]
        if lost and refuse_lost:
            raise RuntimeError(
                f"[rank {user.comm.rank}] {len(lost)} parameters were written in place after compile "
                f"({', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''}), but at ZeRO-3 this rank holds no "
                "value of them (meta placeholders): the write did nothing. Load values with model.load_state_dict(sd) "
                "(fxzero writes them into the shards), set one with fxzero.utils.safe_set_full_fp32_param(p, value), "
                "or write inside `with fxzero.zero.GatheredParameters(params, modifier_rank=0):`")
        if written:
            self.install({fqn: user.params[fqn].detach().clone() for fqn in written}, keep_equal=True)

    def _check_parameters(self) -> None:
        """The model's parameters are the ones the engine was built with: a module replaced after
        compile (`model.head = nn.Linear(...)`, a LoRA layer injected, `resize_token_embeddings`)
        brings parameters the engine holds nothing of, which the programs would never read (they
        computed with the old ones, without a word)."""
        user = self.user
        buffers = {fqn for fqn, _ in user.model.named_buffers(remove_duplicate=False)}
        if buffers != self._buffers:
            said = "; ".join(f"{what} {sorted(names)[:3]}" for what, names in
                             (("new", buffers - self._buffers), ("gone", self._buffers - buffers)) if names)
            raise RuntimeError(
                f"[rank {user.comm.rank}] the model's buffers changed after compile ({said}): the engine holds the "
                "buffers the model had when it was built, and its programs read those. Register buffers before "
                "fxzero.initialize / fxzero.compile (a buffer's value may change at any time: in place, or by "
                "assigning a tensor of its shape), or build a new engine for the changed model")
        now = dict(user.model.named_parameters(remove_duplicate=True))
        if now.keys() == user.params.keys() and all(now[f] is p for f, p in user.params.items()):
            return
        replaced = sorted(f for f in now.keys() & user.params.keys() if now[f] is not user.params[f])
        new, gone = sorted(now.keys() - user.params.keys()), sorted(user.params.keys() - now.keys())
        said = "; ".join(f"{what} {names[:3]}{' ...' if len(names) > 3 else ''}" for what, names in
                         (("replaced", replaced), ("new", new), ("gone", gone)) if names)
        raise RuntimeError(
            f"[rank {user.comm.rank}] the model's parameters changed after compile ({said}): a module replaced or "
            "added (model.head = nn.Linear(...), a LoRA layer, resize_token_embeddings) brings parameters the engine "
            "holds no state of, and its programs would go on computing with the old ones. Change the model before "
            "fxzero.initialize / fxzero.compile, or build a new engine for the changed model")

    def announcements(self) -> tuple[str, ...]:
        """What this rank wrote since the last call, one line per parameter with a digest of its
        values, for the forward's agreement: ranks that wrote different values (a state dict
        loaded on rank 0 only, initializations drawn from each rank's own generator) are an error
        on every rank naming the first parameter, never a model whose ranks compute with different
        weights. Cleared as read."""
        lines, self._announced = tuple(self._announced), []
        return lines

    @torch.no_grad()
    def install(self, values: dict[str, torch.Tensor], keep_equal: bool) -> None:
        """Write full parameter values (FQN -> tensor of its shape) into the units holding them:
        this rank's master shard (a unit held whole: its whole buffer), the compute-dtype copy cast
        from it, on their tier. `keep_equal`: an element whose value equals the master's cast to
        the compute dtype keeps the master's (what a write through the compute-dtype view did not
        change). Local: each rank writes from its own values."""
        user = self.user
        state, low_dtype = user.state, user.compute_dtype
        for fqn in sorted(values):
            raw = values[fqn].detach().contiguous().cpu()
            digest = hashlib.blake2b(raw.view(torch.uint8).numpy().tobytes(), digest_size=8).hexdigest()
            self._announced.append(f"{WRITTEN}{fqn} after compile (digest {digest})")
        for layout in state.layouts:
            slots = [s for s in layout.slots if s.fqn in values]
            if not slots:
                continue
            lo, hi = layout.shard_range(state.rank_of_shards)
            if layout.name in state.whole:  # (its whole buffer in the master dtype: the rest from what is held)
                base = 0
                buf = state.whole_buffer(layout.name)
                if buf is not None:
                    buf = buf.clone()
                else:  # (mixed precision: this rank's master shard and the compute-dtype copy elsewhere)
                    buf = state.whole_buffer(layout.name, compute=True).to(layout.dtype)
                    buf[lo:hi] = state.local_shard(layout.name)
            else:
                base, buf = lo, state.local_shard(layout.name).clone()
            for s in slots:
                a, b = max(base, s.offset), min(base + buf.numel(), s.offset + s.numel)
                if a >= b:
                    continue
                new = values[s.fqn].reshape(-1)[s.start + a - s.offset : s.start + b - s.offset]
                new = new.to(device=buf.device, dtype=buf.dtype)
                region = buf[a - base : b - base]
                if keep_equal:
                    cast = low_dtype if low_dtype is not None and layout.dtype.is_floating_point else layout.dtype
                    new = torch.where(new.to(cast) == region.to(cast), region, new)
                region.copy_(new)
            state.install_unit(layout.name, lambda a, b, buf=buf, base=base: buf[a - base : b - base], low_dtype)
        user.bind(force=True)
