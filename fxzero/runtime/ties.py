"""Which names of a model share one parameter (tied weights), and making another rank's model alike.

[Note: tied weights on every rank alike]
A model held whole by one rank before `initialize` (built in `zero.Init` and loaded by
`from_pretrained` at ZeRO-3: [Note: gathering before initialize] in `fxzero/zero.py`) has values
on its holder and meta placeholders on the other ranks. Code that decides from values decides
there alone: transformers' `tie_weights` after loading a checkpoint that holds both an embedding
and its tied head (`pytorch_model.bin` writes both names) ties them only where it can compare
their values, and skips a pair on the meta device. So the holder's head shares the embedding's
parameter and the others' does not, the ranks' models have different parameters, and their
engines would plan different units. `initialize` therefore gives every rank the holder's ties:
the groups of names that share a parameter travel with the ranks' agreement on where the values
come from (one gather of small objects it makes anyway), and a rank whose model differs
re-ties (or unties) its placeholders to match before anything is planned. With no holder the
ranks built their models alike and must tie alike; a difference is an error naming it.
"""

from __future__ import annotations

import torch.nn as nn

__all__ = ["mirror_ties", "tie_groups"]


def tie_groups(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """The names sharing a parameter, one group per shared parameter (names in the model's
    order, groups by their first name)."""
    names: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(fqn)
    return tuple(sorted(tuple(group) for group in names.values() if len(group) > 1))


def mirror_ties(model: nn.Module, groups: tuple[tuple[str, ...], ...]) -> list[str]:
    """Make the names in each of `groups` share one parameter (the first name's) and every other
    name hold a parameter of its own (a copy of the one it shared, attributes included); returns
    the names changed."""
    want = {fqn: group[0] for group in groups for fqn in group}
    changed = []
    owners: set[int] = set()  # parameters claimed by a name that keeps its own
    for fqn, p in list(model.named_parameters(remove_duplicate=False)):
        if want.get(fqn, fqn) != fqn:
            continue
        if id(p) in owners:  # (shared here, not on the rank mirrored: a copy of its own)
            own = nn.Parameter(p.new_empty(p.shape) if p.is_meta else p.detach().clone(),
                               requires_grad=p.requires_grad)
            own.__dict__.update(p.__dict__)
            _set(model, fqn, own)
            changed.append(fqn)
            p = own
        owners.add(id(p))
    params = dict(model.named_parameters(remove_duplicate=False))
    for fqn, first in want.items():
        if fqn != first and fqn in params and first in params and params[fqn] is not params[first]:
            _set(model, fqn, params[first])
            changed.append(fqn)
    return changed


def _set(model: nn.Module, fqn: str, param: nn.Parameter) -> None:
    owner_name, _, name = fqn.rpartition(".")
    setattr(model.get_submodule(owner_name), name, param)
