"""`engine.optimizer.state_dict()` and `load_state_dict()`: this rank's optimizer shards, as
DeepSpeed's ZeRO optimizers give theirs.

[Note: the optimizer's own state dict]
A script written for torch saves and resumes its optimizer with `torch.save(optimizer.state_dict())`
and `optimizer.load_state_dict(torch.load(...))`, and a DeepSpeed script may do the same with the
engine's optimizer: DeepSpeed's ZeRO optimizers answer with this rank's partition of the states
(and the loss scaler), which the same rank of a run of the same world size loads back. fxzero's
optimizer inherited torch's methods on an optimizer whose `state` is empty (the states are the
engine's shards): the state dict held no moments and no step counts, and a resume from it started
Adam afresh (its moments zero, its bias correction from step 1) without a word.

Now `state_dict()` is this rank's shards, no collective: under "state" one entry per trained unit
(its step count and each optimizer state's shard, read from its tier where it lives on one),
"param_groups" as torch's FQN-keyed optimizer state dicts list them (each group's hyperparameters,
and the names of its parameters), and under "fxzero" what a load checks: the rank, the world size,
the optimizer and its states, and the units' layout. `load_state_dict()` of such a dict on the same
rank of an engine with the same layout puts the shards back (and each group's hyperparameters, and
the loss scaler's state where the dict holds one), as torch's load does (a list of every rank's
dicts, as DeepSpeed's optimizers' `load_state_dict` takes, gives this rank's); any other dict is refused
naming the difference: a dict of another rank or world size (`engine.save_checkpoint` and
`load_checkpoint` reshard), or torch.optim's own (states of whole parameters:
`fxzero.utils.safe_set_full_optimizer_state` sets one parameter's).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from fxzero.runtime.state import install

__all__ = ["load_sharded_state_dict", "sharded_state_dict"]

FORMAT = 1


def _layout_digest(engine) -> str:
    """The units' layout: names, slots and sizes (two engines with the same digest shard alike)."""
    text = repr([(lay.name, lay.trainable, lay.padded_numel, lay.world_size,
                  [(s.fqn, s.offset, s.numel, s.start) for s in lay.slots]) for lay in engine.layouts])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _groups(engine) -> list[dict]:
    from fxzero.runtime.checkpoint.save import _param_groups  # (checkpoint imports the engine's modules)

    return _param_groups(engine)


@torch.no_grad()
def sharded_state_dict(engine) -> dict[str, Any]:
    """This rank's optimizer state ([Note: the optimizer's own state dict]); no collective."""
    from fxzero.runtime.checkpoint.save import state_shard

    state, policy = engine.state, engine.optimizer.policy
    engine.state.settle_grads()
    units = {}
    for layout in engine.layouts:
        if not layout.trainable:
            continue
        entry: dict[str, Any] = {"step": state.steps.get(layout.name, 0)}
        for kind in policy.states:
            entry[kind] = state_shard(engine, layout, kind).clone()
        units[layout.name] = entry
    scaler = engine.control.scaler
    return {
        "state": units,
        "param_groups": _groups(engine),
        "fxzero": {"format": FORMAT, "rank": engine.rank, "world_size": engine.world_size,
                   "optimizer": type(policy).__name__, "states": list(policy.states), "layout": _layout_digest(engine),
                   "loss_scaler": scaler.state_dict() if scaler is not None else None},
    }


@torch.no_grad()
def load_sharded_state_dict(engine, state_dict: Any) -> None:
    """Put back what `sharded_state_dict` gave, on the same rank of an engine sharded alike."""
    rank, policy, state = engine.rank, engine.optimizer.policy, engine.state
    if isinstance(state_dict, (list, tuple)) and len(state_dict) == engine.world_size:
        state_dict = state_dict[rank]  # (every rank's, as DeepSpeed's ZeRO optimizers' load_state_dict takes them)
    meta = state_dict.get("fxzero") if isinstance(state_dict, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(
            f"[rank {rank}] optimizer.load_state_dict: this is not a state dict fxzero's optimizer.state_dict() "
            "gave (it has no 'fxzero' entry): a torch.optim state dict holds the states of whole parameters, and "
            "this optimizer holds this rank's shards. Resume from engine.save_checkpoint with engine.load_checkpoint "
            "(any world size), or set a parameter's state with fxzero.utils.safe_set_full_optimizer_state(param, "
            "value, key)")
    mine = {"rank": rank, "world_size": engine.world_size, "optimizer": type(policy).__name__,
            "states": list(policy.states), "layout": _layout_digest(engine)}
    differ = {k: (meta.get(k), v) for k, v in mine.items() if meta.get(k) != v}
    if differ:
        said = "; ".join(f"{k}: saved {a!r}, here {b!r}" for k, (a, b) in differ.items())
        raise ValueError(
            f"[rank {rank}] optimizer.load_state_dict: the state dict holds another rank's or another run's shards "
            f"({said}). Each rank loads the one it saved, in a run of the same world size, model and optimizer; "
            "to resume on another world size or configuration save with engine.save_checkpoint and load with "
            "engine.load_checkpoint, which reshard")
    groups = state_dict.get("param_groups") or []
    if len(groups) != len(engine.optimizer.param_groups):
        raise ValueError(f"[rank {rank}] optimizer.load_state_dict: {len(groups)} param groups saved, "
                         f"{len(engine.optimizer.param_groups)} here")
    units = state_dict["state"]
    for layout in engine.layouts:
        if not layout.trainable:
            continue
        entry = units[layout.name]
        for kind in policy.states:
            shard = entry[kind].to(device=state.device, dtype=state.state_dtype(layout.name))
            if state.store is not None and state.store.offloaded(kind):
                state.store.put(kind, layout.name, shard)
            else:
                held = state.optimizer_states.setdefault(layout.name, {})
                held[kind] = install(held.get(kind), shard.clone())
        step = int(entry["step"])
        if step:
            state.steps[layout.name] = step
        else:
            state.steps.pop(layout.name, None)
    for group, saved in zip(engine.optimizer.param_groups, groups):  # (the hyperparameters, as torch's load sets them)
        group.update({k: v for k, v in saved.items() if k != "params"})
    engine.optimizer.check_groups()
    scaler = engine.control.scaler
    if scaler is not None and meta.get("loss_scaler") is not None:
        scaler.load_state_dict(meta["loss_scaler"])
