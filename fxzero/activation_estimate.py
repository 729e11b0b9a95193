"""Activation bytes per rank, per `Activations` policy: from the compiled program, and from
Megatron's formula for a transformer block.

[Note: counting saved activations from the program]
The forward program's outputs past the model's own (and past the buffers it mutates) are what it
keeps for the backward: `("saved", name)` in `Program.outputs`. Of those, the gathered
parameters the prefetch keeps for the backward (`node.meta["fxzero"]["kept"]`, the schedule's
`kept`) are parameters, not activations, and are counted apart. The rest are counted as the
runtime counts them (`memory_report()["activations"]`, `storage_bytes`): by storage, so a view
counts its base's bytes once, however many views of it are saved, and even when the base itself
is not saved (a view of a bigger buffer keeps the whole buffer alive). A node is a view when its
operator aliases its input (`OpOverload.is_view`, and `getitem` of a view's result); its base is
followed to the first node that is not one. The one storage the program cannot size is the
caller's: a model input that is a view of a bigger tensor (ids[:, :-1]) keeps that tensor, which
the runtime counts whole and this count as the input's shape.

Each storage is said for what it is, from the recompute regions ([Note: recompute regions] in
`fxzero/trace.py`):

- "input" of a unit: made outside a region and read inside it (the previous block's output,
  the embeddings, positions): what `recompute="unit"` keeps of each unit;
- "random" of a unit: made inside a region by a random operator (dropout) and kept, or the
  generator state kept to draw it again in the backward (whichever is smaller: [Note: replaying
  random operators] in `fxzero/ir/rng.py`);
- "attention" of a unit: what a fused attention inside a region made (its output, its
  logsumexp), kept under `Activations(keep_attention=True)` ([Note: keeping attention] in
  `fxzero/config/activations.py`), or where it takes fewer bytes than the generator state that
  would replay it (torch tags attention as random, for its dropout);
- "inside" of a unit: made inside a region and kept for another reason (a model's own
  checkpoint region's outputs, say);
- "resident": everything else, outside any region or read by the root (counted for "root"): the
  root unit's computation (embeddings, the final norm, the head), the last unit's output, and
  under `recompute="none"`, where there are no regions, everything.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from fxzero.ir.rng import rng_state
from fxzero.ir.sizes import is_fused_attention

__all__ = ["POLICIES", "ActivationCount", "SavedStorage", "count_saved", "estimate_activations", "megatron_per_layer",
           "policy_activations", "transformer_shape"]

_SCOPE = "fxzero_scope"


@dataclasses.dataclass(frozen=True)
class SavedStorage:
    """One storage the forward keeps for the backward."""

    node: str
    """The node whose value owns the storage (the base of the saved views)."""
    nbytes: int
    unit: Optional[str]
    """The region it is counted for (None: root)."""
    kind: str
    """"input", "random", "attention", "inside" or "resident" ([Note: counting saved activations from
    the program])."""


@dataclasses.dataclass(frozen=True)
class ActivationCount:
    """What one policy's forward keeps, per rank."""

    policy: str
    storages: tuple[SavedStorage, ...]
    saved_tensors: int
    """Saved values counted (views included), past the model's outputs and kept parameters."""
    tensor_bytes: int
    """Their bytes counted tensor by tensor from their shapes, views as if they were copies: not
    what memory holds (a view holds its base's storage, shared), shown for the difference."""
    kept_gathered_bytes: int
    """Gathered parameters the prefetch keeps for the backward (not activations)."""
    fused_attention: bool = False
    """The forward computes attention in one operator (scaled_dot_product_attention's kernels),
    which keeps no s^2 scores."""

    @property
    def total(self) -> int:
        return sum(s.nbytes for s in self.storages)

    def by_kind(self) -> dict[str, int]:
        out = {"input": 0, "random": 0, "attention": 0, "inside": 0, "resident": 0}
        for s in self.storages:
            out[s.kind] += s.nbytes
        return out

    def by_unit(self) -> dict[str, dict[str, int]]:
        """{region or "root": {kind: bytes}}, regions in program order."""
        out: dict[str, dict[str, int]] = {}
        for s in self.storages:
            row = out.setdefault(s.unit or "root", {})
            row[s.kind] = row.get(s.kind, 0) + s.nbytes
        return out

    def to_json(self) -> dict:
        return {"policy": self.policy, "total": self.total, "by_kind": self.by_kind(), "by_unit": self.by_unit(),
                "storages": len(self.storages), "saved_tensors": self.saved_tensors, "tensor_bytes": self.tensor_bytes,
                "kept_gathered_bytes": self.kept_gathered_bytes, "fused_attention": self.fused_attention}


def _is_view(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:  # (an element of a view op's list result: split, unbind)
        return isinstance(node.args[0], fx.Node) and _is_view(node.args[0])
    return bool(getattr(node.target, "is_view", False))


def _base(node: fx.Node) -> fx.Node:
    while _is_view(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    try:
        return int(val.untyped_storage().nbytes())
    except (NotImplementedError, RuntimeError):  # (no storage to ask: as if contiguous)
        return val.numel() * val.element_size()


def _random(node: fx.Node) -> bool:
    """A random operator's draw, or the generator state kept to draw it again ([Note: replaying
    random operators] in `fxzero/ir/rng.py`)."""
    if node.target is rng_state:
        return True
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _classify(node: fx.Node) -> tuple[Optional[str], str]:
    scope = node.meta.get(_SCOPE)
    readers = [u.meta.get(_SCOPE) for u in node.users if u.op != "output"]
    outside = next((r for r in readers if r is not None and r != scope), None)
    if outside is not None:
        return outside, "input"
    if scope is None or None in readers:  # (made by a unit, read by the root: the root's input)
        return None, "resident"
    made = node.args[0] if node.target is operator.getitem and isinstance(node.args[0], fx.Node) else node
    return scope, "attention" if is_fused_attention(made) else "random" if _random(node) else "inside"


def count_saved(compiled: Any, policy: str) -> ActivationCount:
    """The saved activations of a `fxzero.compile_program` result
    ([Note: counting saved activations from the program])."""
    program = compiled.programs["forward"]
    results = next(n for n in program.gm.graph.nodes if n.op == "output").args[0]
    storages: dict[str, SavedStorage] = {}
    tensors = tensor_bytes = kept_bytes = 0
    for (kind, _), node in zip(program.outputs, results):
        if kind != "saved" or not isinstance(node, fx.Node) or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        if node.meta.get("fxzero", {}).get("kept"):
            kept_bytes += _nbytes(node)
            continue
        tensors += 1
        tensor_bytes += node.meta["val"].numel() * node.meta["val"].element_size()
        base = _base(node)
        if base.name not in storages:
            unit, what = _classify(node if base is node else base)
            storages[base.name] = SavedStorage(base.name, _nbytes(base), unit, what)
    fused = any(n.op == "call_function" and "attention" in str(n.target) for n in program.gm.graph.nodes)
    return ActivationCount(policy, tuple(storages.values()), tensors, tensor_bytes, kept_bytes, fused)


POLICIES = ("none", "unit", "unit-attention", "selective")
"""What `estimate_activations` counts: `Activations(recompute=...)`, and "unit-attention" for
`Activations(recompute="unit", keep_attention=True)`."""


def policy_activations(policy: str) -> Any:
    """The `fxzero.Activations` a policy of `POLICIES` names."""
    import fxzero

    if policy not in POLICIES:
        raise ValueError(f"unknown activation policy {policy!r}; choose one of {POLICIES}")
    if policy == "unit-attention":
        return fxzero.Activations(recompute="unit", keep_attention=True)
    return fxzero.Activations(recompute=policy)


def estimate_activations(model: nn.Module, args: Sequence[torch.Tensor], config: Any, *, world_size: int,
                         kwargs: Optional[Mapping[str, Any]] = None, policies: Sequence[str] = ("none", "unit"),
                         device: str = "cpu") -> dict[str, ActivationCount]:
    """Compile `model(*args, **kwargs)` (a meta model: nothing is allocated) under each policy of
    `POLICIES`, with `config`'s other settings, and count what each forward keeps."""
    import fxzero

    out = {}
    for policy in policies:
        cfg = dataclasses.replace(config, activations=policy_activations(policy))
        compiled = fxzero.compile_program(model, args, cfg, world_size=world_size, kwargs=kwargs, device=device)
        out[policy] = count_saved(compiled, policy)
    return out


# ---------------------------------------------------------------------------------------------
# Megatron's formula (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
# Transformer Models", section 4.1)

_SHAPE_FIELDS = {
    "hidden": ("d_model", "hidden_size", "n_embd"),
    "heads": ("n_heads", "num_attention_heads", "n_head"),
    "layers": ("n_blocks", "num_hidden_layers", "n_layer"),
}


def transformer_shape(model: nn.Module) -> Optional[dict[str, int]]:
    """(hidden, heads, layers) from `model.config` (fxzero's zoo, Hugging Face names); None when
    the config does not say them."""
    config = getattr(model, "config", None)
    shape = {}
    for key, names in _SHAPE_FIELDS.items():
        value = next((getattr(config, n) for n in names if isinstance(getattr(config, n, None), int)), None)
        if value is None:
            return None
        shape[key] = value
    return shape


def megatron_per_layer(seq: int, batch: int, hidden: int, heads: int, *, itemsize: int = 2,
                       dropout: bool = True, fused_attention: bool = False, recompute: str = "none") -> int:
    """Activation bytes per transformer layer, by the paper's accounting (tensor parallel 1).

    Without recompute: 16 tensors' worth of s*b*h values (layer norms' inputs, QKV's input, Q
    and K, V, the output projection's input, the MLP's input, its 4h GELU input and output) at
    `itemsize` bytes, 1-byte dropout masks after attention and after the MLP (2 s*b*h), and the
    attention scores: softmax output, dropout output and its mask (`itemsize`, `itemsize` and 1
    bytes per a*s^2*b), gone with fused attention (which recomputes them). At `itemsize` 2 with
    dropout: 34 s*b*h + 5 a*s^2*b. With full recompute, each layer keeps only its input: s*b*h
    values (2 s*b*h bytes in 16 bits). Selective recompute (the paper's) recomputes the attention
    scores and keeps the rest: the fused-attention figure, 34 s*b*h.
    """
    sbh = seq * batch * hidden
    fused_attention = fused_attention or recompute == "selective"
    if recompute == "unit":
        return itemsize * sbh
    per = 16 * itemsize * sbh + (2 * sbh if dropout else 0)
    if not fused_attention:
        per += (itemsize + ((itemsize + 1) if dropout else 0)) * heads * seq * seq * batch
    return per
