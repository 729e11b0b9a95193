"""`fxzero estimate --params N | MODEL`: per-rank memory of model states, by ZeRO stage."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Optional

import click

from fxzero import estimate
from fxzero.activation_estimate import POLICIES as ACTIVATION_POLICIES
from fxzero.cli.common import CLIError, DEFAULT_WORLD, MODEL_CONFIG_HELP, reports_errors
from fxzero.viz.fmt import human_bytes, human_count

__all__ = ["estimate_command", "parse_count"]

STAGE_NAMES = {0: "no ZeRO (DDP)", 1: "ZeRO-1 (optimizer)", 2: "ZeRO-2 (+ gradients)", 3: "ZeRO-3 (+ parameters)"}
PRECISIONS = {"fp32": "fp32: 4+4+8 B/param", "mixed": "bf16: 2+2+12 B/param"}
"""The columns: fp32 training, and Config(mixed_precision=MixedPrecision(reduce_dtype=None)) (the
ZeRO paper's arithmetic; the default fp32 reduction holds 4-byte gradients, 2+4+12)."""


def parse_count(text: str) -> float:
    """'124M' -> 124e6, '6.7B' -> 6.7e9, '7e9' and '6,738,415,616' as written."""
    m = re.fullmatch(r"\s*([0-9][0-9_,]*\.?[0-9]*(?:e[0-9]+)?)\s*([kmbt]?)\s*", text.lower())
    if not m:
        raise CLIError(f"--params {text!r}: expected a count like 124M, 6.7B, 7e9 or 124439808")
    value = float(m.group(1).replace(",", "").replace("_", ""))
    return value * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2)]


def offload_policy(tier: Optional[str]):
    """The `fxzero.Offload` `--offload cpu|nvme` stands for: parameters (at stage 3) and
    optimizer states on that tier, gradients with the optimizer states, as DeepSpeed's
    offload_param / offload_optimizer do. (No file is written: the NVMe path is a placeholder.)"""
    from fxzero.config import Cpu, Nvme, Offload

    if tier is None:
        return None
    placement = Cpu() if tier == "cpu" else Nvme(path="nvme")
    return Offload(params=placement, optimizer=placement)


def _rows(phi: float, world: int, offload, layouts=None) -> list[dict]:
    rows = []
    for stage in estimate.STAGES:
        row = {"stage": stage, "name": STAGE_NAMES[stage]}
        for precision in estimate.BYTES_PER_PARAM:
            if layouts is None:
                states = estimate.paper_model_states(phi, world, stage, precision)
            else:
                states = estimate.runtime_model_states(layouts, stage, precision)
            row[precision] = {
                "params": states.params, "grads": states.grads, "optimizer": states.optimizer,
                "total": states.total, "placement": estimate.place(states, stage, offload).to_json(),
            }
        rows.append(row)
    return rows


@click.command("estimate")
@click.argument("model", required=False)
@click.option("--params", "params_text", default=None, metavar="N",
              help="Parameter count instead of a MODEL (124M, 6.7B, 7e9): the ZeRO paper's formulas.")
@click.option("--model-config", "model_config", default=None, metavar="JSON|PATH", help=MODEL_CONFIG_HELP)
@click.option("--world", type=click.IntRange(min=1), default=DEFAULT_WORLD, show_default=True,
              help="Total ranks (data-parallel degree).")
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Nodes the ranks are spread over (cpu and nvme bytes are also shown per node).")
@click.option("--offload", type=click.Choice(["cpu", "nvme"]), default=None,
              help="Move optimizer states (and, at stage 3, parameter shards) off the device.")
@click.option("--accumulation", type=click.IntRange(min=1), default=1, show_default=True, metavar="K",
              help="With MODEL: also show gradient accumulation over K micro-steps under both policies "
                   "(Config.gradient_accumulation): gradient bytes held and reduce-scatter bytes per optimizer step.")
@click.option("--activations", "activations", type=click.Choice([*ACTIVATION_POLICIES, "all"]), default=None,
              help="With MODEL: also the activation bytes per rank the forward keeps for the backward under "
                   "Activations(recompute=...) (unit-attention: recompute='unit', keep_attention=True; all: each), "
                   "counted from the compiled program, and Megatron's formula beside them for a transformer. "
                   "Implied by --seq or --micro-batch.")
@click.option("--seq", type=click.IntRange(min=1), default=None, metavar="S",
              help="Sequence length of the activation estimate (dimension 1 of the token inputs; default: the "
                   "model's example inputs').")
@click.option("--micro-batch", "micro_batch", type=click.IntRange(min=1), default=None, metavar="B",
              help="Micro-batch per rank of the activation estimate (default: the model's example inputs').")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON (bytes).")
def estimate_command(model: Optional[str], params_text, model_config, world, nodes, offload, accumulation,
                     activations, seq, micro_batch, as_json):
    """Per-rank memory of model states (params + grads + Adam) for each ZeRO stage.

    With MODEL the figures come from the same unit layouts the runtime allocates (padding
    included); with --params N from the paper's arithmetic: 16 Phi without ZeRO, then
    4 Phi + 12 Phi/N, 2 Phi + 14 Phi/N and 16 Phi/N in mixed precision. Temporary buffers are
    not included; activations are with --activations (MODEL only), per policy, at --seq and
    --micro-batch: what the compiled forward keeps for the backward, as memory_report() counts it.
    """
    if (model is None) == (params_text is None):
        raise CLIError("give either MODEL or --params N (e.g. `fxzero estimate --params 7B --world 64`)")
    if model_config is not None and model is None:
        raise CLIError("--model-config describes a MODEL (transformers:ClassName); --params N needs none")
    if activations is None and (seq is not None or micro_batch is not None):
        activations = "all"
    if activations is not None and model is None:
        raise CLIError("--activations, --seq and --micro-batch need a MODEL (its program says what the forward keeps)")
    if world % nodes:
        raise CLIError(f"--world {world} ranks cannot be split evenly over --nodes {nodes}")
    layouts = None
    if model is not None:
        from fxzero.config import UnitsPolicy
        from fxzero.modelspec import build_model
        from fxzero.units import plan_units

        with reports_errors(f"planning units of {model}"):
            layouts = plan_units(build_model(model, model_config=model_config), UnitsPolicy(), world)
        phi = float(sum(u.numel for u in layouts))
    else:
        phi = parse_count(params_text)
    rows = _rows(phi, world, offload_policy(offload), layouts)
    per_node = world // nodes
    largest = estimate.largest_unit(layouts) if layouts else None
    result = {
        "model": model, "params": phi, "world": world, "nodes": nodes, "ranks_per_node": per_node,
        "offload": offload, "accounting": "runtime unit layouts" if layouts else "ZeRO paper formulas",
        "per_rank": rows,
    }
    if accumulation > 1:
        if layouts is None:
            raise CLIError("--accumulation needs a MODEL (its unit layouts say what is reduced)")
        result["accumulation"] = {
            "steps": accumulation,
            "per_stage": {stage: {policy: dataclasses.asdict(cost) for policy, cost in
                                  estimate.accumulation_costs(layouts, stage, accumulation).items()}
                          for stage in (1, 2, 3)},
        }
    if largest is not None:
        result["largest_unit"] = {"name": largest.name, "numel": largest.padded_numel,
                                  "fp32_bytes": largest.padded_numel * largest.itemsize,
                                  "mixed_bytes": largest.padded_numel * 2}
    if activations is not None:
        from fxzero.cli.estimate_activations import activations_result

        result["activations"] = activations_result(model, model_config, world, activations, seq, micro_batch)
    if as_json:
        click.echo(json.dumps(result, indent=1))
        return
    _print(result, layouts)


def _print(result: dict, layouts) -> None:
    phi, world, nodes, offload = result["params"], result["world"], result["nodes"], result["offload"]
    what = result["model"] or "--params"
    units = f" in {len(layouts)} units" if layouts else ""
    click.echo(f"{what}: {human_count(phi)} parameters ({phi:,.0f}){units}; {world} ranks"
               + (f" = {nodes} nodes x {result['ranks_per_node']}" if nodes > 1 else "")
               + f"; offload: {offload or 'none'}; accounting: {result['accounting']}")
    tiers = ["device"] + ([offload] if offload else [])
    col = 11
    group = {p: max(len(PRECISIONS[p]) + 3, col * len(tiers) + 3) for p in estimate.BYTES_PER_PARAM}
    click.echo(f"{'model states per rank':<24}" + "".join(f"{PRECISIONS[p]:<{group[p]}}" for p in group).rstrip())
    if offload:
        click.echo(f"{'':<24}" + "".join(f"{''.join(f'{t:<{col}}' for t in tiers):<{group[p]}}" for p in group).rstrip())
    for row in result["per_rank"]:
        cells = ""
        for p in group:
            placement = row[p]["placement"]
            text = "".join(f"{human_bytes(placement[t]) if placement[t] else '-':<{col}}" for t in tiers)
            cells += f"{text:<{group[p]}}"
        click.echo(f"{row['name']:<24}{cells}".rstrip())
    if offload:
        r3 = result["per_rank"][3]
        click.echo(f"{offload} per node at ZeRO-3 ({result['ranks_per_node']} ranks): "
                   f"fp32 {human_bytes(r3['fp32']['placement'][offload] * result['ranks_per_node'])}, "
                   f"mixed {human_bytes(r3['mixed']['placement'][offload] * result['ranks_per_node'])}")
    if "largest_unit" in result:
        lu = result["largest_unit"]
        click.echo(f"ZeRO-3 also gathers units on the device while they are used: the largest, {lu['name']}, "
                   f"is {human_bytes(lu['fp32_bytes'])} in fp32 ({human_bytes(lu['mixed_bytes'])} in 16 bits); "
                   "prefetch holds the next one too")
    if "accumulation" in result:
        acc = result["accumulation"]
        click.echo(f"gradient accumulation over {acc['steps']} micro-steps, fp32 gradients, per rank per optimizer "
                   "step (Config.gradient_accumulation):")
        for stage, costs in acc["per_stage"].items():
            sharded, local = costs["sharded"], costs["local"]
            click.echo(f"  ZeRO-{stage}: \"sharded\" holds {human_bytes(sharded['grads_held'])} of gradients and "
                       f"reduce-scatters {human_bytes(sharded['reduce_scatter_bytes'])}; \"local\" holds "
                       f"{human_bytes(local['grads_held'])} and reduce-scatters "
                       f"{human_bytes(local['reduce_scatter_bytes'])}")
    if "activations" in result:
        from fxzero.cli.estimate_activations import print_activations

        print_activations(result["activations"])
        click.echo("not included: temporary buffers, framework overhead")
    else:
        click.echo("not included: activations (--activations), temporary buffers, framework overhead")
