"""`fxzero estimate MODEL --activations none|unit|selective|all --seq S --micro-batch B`: activation bytes
per rank per `Activations` policy, from the compiled program and from Megatron's formula."""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import click
import torch
import torch.nn as nn

from fxzero import activation_estimate as act
from fxzero.cli.common import CLIError, reports_errors
from fxzero.viz.fmt import human_bytes

__all__ = ["activations_result", "print_activations", "shaped_call"]

POLICIES = {**{p: (p,) for p in act.POLICIES}, "all": act.POLICIES}

_POSITIONS = ("seq_len", "max_position_embeddings", "n_positions")
"""Config fields that bound a model's sequence (zoo, Hugging Face), in the order asked."""


_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _position_limit(model: nn.Module) -> Optional[tuple[str, int]]:
    config = getattr(model, "config", None)
    for field in _POSITIONS:
        value = getattr(config, field, None)
        if isinstance(value, int) and value > 0:
            return field, value
    return None


def shaped_call(model: nn.Module, spec: str, seq: Optional[int], batch: Optional[int]):
    """The model's default call (its example inputs, or a Hugging Face model's) with dimension 0
    of every tensor set to `batch` and dimension 1 of every integer tensor of 2 or more dimensions
    (token ids, masks) to `seq`."""
    from fxzero.modelspec import CallSpec, InputSpec, example_call

    call = example_call(model, what=f"MODEL {spec!r}")

    def shaped(s: InputSpec) -> InputSpec:
        shape = list(s.shape)
        if batch is not None and shape:
            shape[0] = batch
        if seq is not None and len(shape) >= 2 and not s.dtype.is_floating_point:
            shape[1] = seq
        return dataclasses.replace(s, shape=tuple(shape))

    if seq is not None:
        tokens = [s for s in (*call.spec.args, *(v for _, v in call.spec.kwargs)) if isinstance(s, InputSpec)
                  and len(s.shape) >= 2 and not s.dtype.is_floating_point]
        if not tokens:
            raise CLIError(f"--seq sets dimension 1 of MODEL's token inputs (integer [B,T] tensors); {spec} is "
                           f"called on '{call.spec}', which has none: leave --seq out")
        limit = _position_limit(model)
        if limit is not None and seq > limit[1]:
            field, value = limit
            if field == "seq_len" and not spec.startswith("transformers:"):  # (a zoo model's argument)
                longer = (re.sub(rf"{field}\s*=\s*\d+", f"{field}={seq}", spec) if field in spec
                          else f"{spec[:-1]}, {field}={seq})" if spec.endswith(")") else f"{spec}({field}={seq})")
                fix = f"'{longer}'"
            else:
                fix = f"--model-config '{{\"{field}\": {seq}}}'"
            raise CLIError(f"--seq {seq}: {spec} covers sequences up to {value} ({field}); build it longer: {fix}")
    new = CallSpec(tuple(shaped(s) for s in call.spec.args),
                   tuple((k, shaped(v) if isinstance(v, InputSpec) else v) for k, v in call.spec.kwargs))
    args, kwargs = new.make(torch.Generator().manual_seed(0))
    return new, args, kwargs


def _megatron(model: nn.Module, seq: int, batch: int, fused: bool) -> Optional[dict]:
    shape = act.transformer_shape(model)
    if shape is None:
        return None
    h, a, layers = shape["hidden"], shape["heads"], shape["layers"]
    dtype = next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), torch.float32)
    dropout = any(isinstance(m, _DROPOUTS) and m.p > 0 for m in model.modules())
    published = {"none": act.megatron_per_layer(seq, batch, h, a),
                 "none_fused_attention": act.megatron_per_layer(seq, batch, h, a, fused_attention=True),
                 "unit": act.megatron_per_layer(seq, batch, h, a, recompute="unit"),
                 "selective": act.megatron_per_layer(seq, batch, h, a, recompute="selective")}
    here = {p: act.megatron_per_layer(seq, batch, h, a, itemsize=dtype.itemsize, dropout=dropout,
                                      fused_attention=fused, recompute=p) for p in ("none", "unit", "selective")}
    return {"hidden": h, "heads": a, "layers": layers, "seq": seq, "micro_batch": batch,
            "published_per_layer": published, "assumptions": "16-bit activations, 1-byte dropout masks, "
            "MLP of 4h, no tensor or sequence parallelism; full recompute keeps each layer's input; "
            "selective recompute recomputes the attention scores (34sbh)",
            "this_model": {"itemsize": dtype.itemsize, "dropout": dropout, "fused_attention": fused,
                           "per_layer": here, "layers_total": {p: v * layers for p, v in here.items()}}}


def activations_result(spec: str, model_config, world: int, policy: str, seq: Optional[int],
                       batch: Optional[int]) -> dict:
    """The "activations" entry of `fxzero estimate --json`."""
    import fxzero
    from fxzero.modelspec import build_model

    with reports_errors(f"estimating the activations of {spec}"):
        model = build_model(spec, model_config=model_config)
        call, args, kwargs = shaped_call(model, spec, seq, batch)
        counts = act.estimate_activations(model, args, fxzero.Config(cost_model=None), world_size=world,
                                          kwargs=kwargs, policies=POLICIES[policy])
    tokens = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() >= 2
              and not t.dtype.is_floating_point]
    first = next(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
    seq_used = tokens[0].shape[1] if tokens else None
    result = {"call": str(call), "seq": seq_used, "micro_batch": first.shape[0] if first.dim() else None,
              "accounting": "the forward program's saved tensors, storages counted once (as memory_report() "
                            "counts them), gathered parameters kept for the backward apart",
              "per_policy": {p: c.to_json() for p, c in counts.items()}}
    if seq_used is not None:
        fused = any(c.fused_attention for c in counts.values())
        result["megatron"] = _megatron(model, seq_used, result["micro_batch"], fused)
    return result


def print_activations(result: dict) -> None:
    what = f"sequence {result['seq']}, " if result["seq"] is not None else ""
    click.echo(f"activations per rank, micro-batch {result['micro_batch']}, {what}traced on '{result['call']}' "
               "(the forward program's saved tensors; storages counted once):")
    for policy, c in result["per_policy"].items():
        kinds = c["by_kind"]
        units = [u for u in c["by_unit"] if u != "root"]
        parts = [f"resident {human_bytes(kinds['resident'])}" + (" (root)" if units else "")]
        if kinds["input"]:
            parts.insert(0, f"unit inputs {human_bytes(kinds['input'])} ({len(units)} units)")
        if kinds["random"]:
            parts.insert(1, f"random draws or their generator states kept {human_bytes(kinds['random'])} "
                                "(dropout)")
        if kinds["attention"]:
            parts.insert(1, f"fused attention's outputs {human_bytes(kinds['attention'])}")
        if kinds["inside"]:
            parts.insert(1, f"other kept inside units {human_bytes(kinds['inside'])}")
        label = 'recompute="unit", keep_attention=True' if policy == "unit-attention" else f'recompute="{policy}"'
        click.echo(f"  {label}: {human_bytes(c['total'])}: " + ", ".join(parts))
        groups: dict[tuple, list[str]] = {}  # (units keeping the same bytes, on one line)
        for unit in units:
            groups.setdefault(tuple(sorted(c["by_unit"][unit].items())), []).append(unit)
        for row, names in groups.items():
            which = names[0] if len(names) == 1 else f"{len(names)} units, {names[0]} .. {names[-1]}, each"
            click.echo(f"    {which}: " + ", ".join(f"{kind} {human_bytes(n)}" for kind, n in row))
    kept = next(iter(result["per_policy"].values()))["kept_gathered_bytes"]
    if kept:
        click.echo(f"  (apart: {human_bytes(kept)} of gathered parameters the prefetch keeps for the backward)")
    m = result.get("megatron")
    if m:
        pub, here = m["published_per_layer"], m["this_model"]
        click.echo(f"Megatron's formula (Korthikanti et al. 2022) per layer, h={m['hidden']} a={m['heads']}, "
                   f"x {m['layers']} layers; {m['assumptions']}:")
        click.echo(f"  as published, 34sbh + 5as^2b: {human_bytes(pub['none'])} "
                   f"({human_bytes(pub['none_fused_attention'])} with fused attention, 34sbh); "
                   f"full recompute, 2sbh: {human_bytes(pub['unit'])}; selective, 34sbh: {human_bytes(pub['selective'])}")
        notes = f"{here['itemsize']}-byte values, {'with dropout (1-byte masks)' if here['dropout'] else 'no dropout'}, " \
                f"{'fused' if here['fused_attention'] else 'unfused'} attention"
        click.echo(f"  at this model ({notes}): none {human_bytes(here['per_layer']['none'])} per layer, "
                   f"{human_bytes(here['layers_total']['none'])} for the layers; unit "
                   f"{human_bytes(here['per_layer']['unit'])} per layer, {human_bytes(here['layers_total']['unit'])}; "
                   f"selective {human_bytes(here['per_layer']['selective'])} per layer, "
                   f"{human_bytes(here['layers_total']['selective'])}")
