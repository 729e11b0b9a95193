"""The simulator against published cluster results: MosaicML llm-foundry's MPT table.

    python tools/check_published.py [--rows N] [--cache DIR] [--json PATH] [--markdown PATH]
    python tools/check_published.py --checkpointed [...]

For every bf16 row of `tests/data/published/llm_foundry.csv` without activation checkpointing
(MPT models with Composer's FSDP on 8 to 512 A100s and H100s, sequence 512 to 65536), it
compiles the row's model shape (the zoo GPT at MPT's dimensions, with the loss inside the
program) on fake tensors for CUDA at the row's micro-batch and sequence, ZeRO-3 for FULL_SHARD
and ZeRO-2 for SHARD_GRAD_OP, gradients reduced in fp32 (Composer's DEFAULT) or bf16 (PURE),
and simulates it on the GPU type's preset (`fxzero.cost.PRESETS`) at the row's world size. It
prints predicted / published tokens per second per GPU for each row, the median and the worst,
and writes it all as JSON.

How a row is priced ([Note: pricing a published row]):
- The model is compiled with 2 and with 3 blocks; the step of L blocks is the 2-block step plus
  L - 2 times the difference (every block is the same unit, gathered, computed and reduced the
  same way: [Note: pricing by depth] in `fxzero/plan/extrapolate.py`, which `fxzero plan` uses
  too), which keeps 77 distinct shapes, from 125M to 13B parameters, to seconds each.
- A program compiled for 8 ranks is priced at the row's world size (`CostModel.at_world`): a
  rank's collectives move the same bytes at any world size (the shard padding aside); the
  ring's length and whether it leaves a node change.
- Gradient accumulation as Composer's FSDP1 does it: every micro-batch gathers, computes and
  reduce-scatters again; the optimizer step runs once. A step is GA x the micro-step (forward
  and backward, until the step program starts) plus the step program.
- One efficiency set per GPU type, fitted on two named rows (`CALIBRATION`) and then held
  fixed for every other row: the matmul efficiency on MPT-1B at sequence 2048, the fused
  attention's on MPT-1B at 16384 (one row cannot fix both: the issue's one-row protocol, with
  attention at its stated ratio, is what `--one-row` runs). The rest is the preset's.

`--checkpointed` checks the rows WITH activation checkpointing instead ([Note: the checkpointed
rows]): the same pricing, each row's program compiled with `fxzero.Activations(recompute="unit")`,
on the efficiencies fitted on the same named rows without checkpointing (nothing is fitted on a
checkpointed row). Each row also carries its prediction without recompute, and the rows that
cannot be modelled are listed with the reason (`not_modelled`), not dropped.

[Note: the checkpointed rows]
Composer's FSDP with `activation_checkpointing: true` wraps every MPT block (llm-foundry's
`activation_checkpointing_target` defaults to the block) in torch's checkpoint wrapper: the
block keeps its input and its forward runs again inside the backward, after the block's
parameters are gathered for the backward, once. That is `recompute="unit"` with a unit per
block (the embeddings, head and loss stay resident in both). The table marks it in
`activation_checkpointing` ("True"), and its HFU is 4/3 of its MFU on every such row: the
source counts one more forward per step. Of the 79 checkpointed rows, the one in fp8
(`amp_fp8`) cannot be modelled (fxzero has no fp8 compute); none offloads activations
(`activation_cpu_offload` is "False" on every row; one that did would be listed too). A recompute
program extrapolates from 2 and 3 blocks like one without (MPT-760M at 65536 and MPT-1B at 2048
against full compiles of 24 blocks: within 0.04%), so `steady_depth` is not needed here.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import fxzero
from fxzero import cost
from fxzero.config.precision import MixedPrecision
from fxzero.plan.extrapolate import NextTokenLoss, compile_at_depth, extrapolate, micro_and_step, repeated_blocks
from fxzero.schedule.types import Schedule
from fxzero.zoo.gpt_model import GPT, GPTConfig

TABLE = os.path.join(ROOT, "tests", "data", "published", "llm_foundry.csv")

MPT = {  # scripts/train/yamls/pretrain/mpt-*.yaml at llm-foundry 8c8dd48: d_model, n_heads, n_layers
    "125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24), "1b": (2048, 16, 24),
    "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 56, 48),
    "70b": (8192, 64, 80),
}
VOCAB = 50368

PRESET_OF = {"a100_40gb": "a100-40gb", "a100_80gb": "a100-80gb", "h100_80gb": "h100-80gb"}
"""The preset each GPU type of the table is simulated on."""

CALIBRATION = {
    # GPU type -> the rows (source_line of the table) its matmul and its attention efficiency are
    # fitted to: MPT-1B on one node of 8 at sequence 2048 (mostly matmuls) and 16384 (mostly
    # attention).
    "a100_40gb": (274, 267),
    "a100_80gb": (199, 196),
    "h100_80gb": (138, 132),
}


def _why_not(row: dict) -> str | None:
    """Why `row` cannot be modelled here, or None where it can."""
    if row["precision"] not in ("amp_bf16", "bf16"):
        return f"precision {row['precision']}: fxzero has no fp8 compute"
    if row["activation_cpu_offload"] != "False":
        return "activation_cpu_offload: Composer's offload of checkpointed activations to host memory is not modelled"
    if row["gpu"] not in PRESET_OF:
        return f"GPU {row['gpu']}: no preset"
    return None


def _read(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def load_rows(path: str = TABLE, *, checkpointed: bool = False) -> list[dict]:
    """The rows this check uses: bf16, no CPU offload, without activation checkpointing
    (`checkpointed`: with it)."""
    want = "True" if checkpointed else "False"
    return [r for r in _read(path) if r["activation_checkpointing"] == want and _why_not(r) is None]


def not_modelled(path: str = TABLE) -> list[dict]:
    """The checkpointed rows `load_rows(checkpointed=True)` leaves out, each with the reason."""
    return [{"source_line": int(r["source_line"]), "model": r["model"], "gpu": r["gpu"], "gpus": int(r["gpus"]),
             "seq_len": int(r["seq_len"]), "published": float(r["tokens_per_s_per_gpu"]), "reason": _why_not(r)}
            for r in _read(path) if r["activation_checkpointing"] == "True" and _why_not(r) is not None]


def _checkpointed(row: dict) -> bool:
    return row["activation_checkpointing"] == "True"


def _key(row: dict, recompute: str | None = None) -> tuple:
    """The compiled shape of `row`; `recompute` overrides what its checkpointing says."""
    if recompute is None:
        recompute = "unit" if _checkpointed(row) else "none"
    return (row["model"], int(row["seq_len"]), int(row["micro_batch"]),
            3 if row["sharding"] == "FULL_SHARD" else 2, row["mp_mode"], recompute)


def compile_shape(key: tuple, n_blocks: int, world: int = 8) -> Schedule:
    """The schedule of one micro-step of `key`'s shape with `n_blocks` blocks, for CUDA ranks:
    the MPT model built at its full depth on the meta device and compiled with its first
    `n_blocks` (`fxzero.plan.extrapolate.compile_at_depth`), the loss in the program; with
    `recompute="unit"` every block recomputed in the backward ([Note: the checkpointed rows])."""
    model, seq, micro, stage, mp_mode, recompute = key
    d_model, n_heads, n_layers = MPT[model]
    cfg = GPTConfig(vocab_size=VOCAB, d_model=d_model, n_heads=n_heads, n_blocks=n_layers, seq_len=seq)
    with torch.device("meta"):
        lm = NextTokenLoss(GPT(cfg))
    idx = torch.zeros(micro, seq, dtype=torch.long, device="meta")
    reduce = torch.float32 if mp_mode == "DEFAULT" else None  # PURE reduces in bf16
    config = fxzero.Config(stage=stage, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce),
                           activations=fxzero.Activations(recompute=recompute))
    blocks, _ = repeated_blocks(lm)
    return compile_at_depth(lm, n_blocks, (idx, idx), config, world_size=world, device="cuda", blocks=blocks).schedule


def schedule_of(key: tuple, n_blocks: int, *, cache: str | None = None, log=print) -> Schedule:
    """`compile_shape(key, n_blocks)`, read from `cache` (a directory) where an earlier run left it."""
    path = os.path.join(cache, "_".join(map(str, key)) + f"_{n_blocks}.json") if cache else None
    if path and os.path.exists(path):
        with open(path) as f:
            return Schedule.loads(f.read())
    start = time.perf_counter()
    schedule = compile_shape(key, n_blocks)
    log(f"compiled {key} x{n_blocks} blocks in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    if path:
        os.makedirs(cache, exist_ok=True)
        with open(path, "w") as f:
            f.write(schedule.dumps())
    return schedule


def predict(row: dict, schedules: tuple[Schedule, Schedule], model: cost.CostModel) -> dict:
    """Tokens per second per GPU the simulator predicts for `row` ([Note: pricing a published row])."""
    at = model.at_world(int(row["gpus"]))
    (m2, s2), (m3, s3) = (micro_and_step(s, at) for s in schedules)
    layers = MPT[row["model"]][2]
    micro_s = extrapolate(m2, m3, layers)
    step_s = extrapolate(s2, s3, layers)
    ga = int(row["grad_accum"])
    seconds = ga * micro_s + step_s
    tokens = int(row["micro_batch"]) * int(row["seq_len"]) * ga
    return {"step_seconds": seconds, "tokens_per_s_per_gpu": tokens / seconds}


def _with(base: cost.CostModel, **rates) -> cost.CostModel:
    new = dataclasses.replace(base.rates, **rates)
    return dataclasses.replace(base, rates=new, flops_per_s=new.matmul_flops_per_s(new.default_dtype))


def _fit(row: dict, schedules, base: cost.CostModel, field: str) -> cost.CostModel:
    """`base` with the `field` of its rates at which `row` is predicted as published (bisection:
    the prediction grows with either efficiency)."""
    want = float(row["tokens_per_s_per_gpu"])
    lo, hi = 0.02, 1.0
    if predict(row, schedules, _with(base, **{field: hi}))["tokens_per_s_per_gpu"] < want:
        raise ValueError(f"row {row['source_line']} is faster than {base.name} with {field}=1: check the preset's figures")
    for _ in range(40):
        mid = (lo + hi) / 2
        if predict(row, schedules, _with(base, **{field: mid}))["tokens_per_s_per_gpu"] < want:
            lo = mid
        else:
            hi = mid
    return _with(base, **{field: (lo + hi) / 2})


ISSUE_ATTENTION = {"a100_40gb": 0.86, "a100_80gb": 0.86, "h100_80gb": 0.66}
"""`--one-row`: fused attention at issue 26's measured ratio to the matmul rate (0.43 A100,
0.33 H100), which counts a causal kernel's work (half the score matrix), doubled because
torch's SDPA formula, which the program's FLOPs come from, counts the whole matrix."""


def calibrate(gpu: str, by_line: dict, compiled: dict, *, one_row: bool = False) -> cost.CostModel:
    """The GPU type's preset with its matmul efficiency fitted to its 2048-token row and its
    attention efficiency to its long-sequence row (each fit moves the other row a little:
    alternated until both hold); `one_row`: the matmul efficiency only, attention at
    `ISSUE_ATTENTION`."""
    matmul_row, attention_row = (by_line[line] for line in CALIBRATION[gpu])
    model = cost.preset(PRESET_OF[gpu])
    if one_row:
        return _fit(matmul_row, compiled[_key(matmul_row)], _with(model, attention_efficiency=ISSUE_ATTENTION[gpu]),
                    "matmul_efficiency")
    for _ in range(4):
        model = _fit(matmul_row, compiled[_key(matmul_row)], model, "matmul_efficiency")
        model = _fit(attention_row, compiled[_key(attention_row)], model, "attention_efficiency")
    return model


def check(rows: list[dict], *, cache: str | None = None, one_row: bool = False, log=print) -> dict:
    """Every row predicted; the figures as a JSON-ready dict. A checkpointed row also carries its
    prediction without recompute (`predicted_without_recompute`) and the ratio of the two
    (`recompute_slowdown`: how much slower the simulator says recompute makes it)."""
    compiled: dict[tuple, tuple[Schedule, Schedule]] = {}
    named = {line for lines in CALIBRATION.values() for line in lines}
    keys = [_key(r) for r in rows + [r for r in load_rows() if int(r["source_line"]) in named]]
    keys += [_key(r, "none") for r in rows if _checkpointed(r)]
    for key in keys:
        if key not in compiled:
            compiled[key] = tuple(schedule_of(key, n, cache=cache, log=log) for n in (2, 3))
    by_line = {int(r["source_line"]): r for r in load_rows()}
    models = {gpu: calibrate(gpu, by_line, compiled, one_row=one_row) for gpu in CALIBRATION}
    out = []
    for row in rows:
        got = predict(row, compiled[_key(row)], models[row["gpu"]])
        published = float(row["tokens_per_s_per_gpu"])
        out.append({"source_line": int(row["source_line"]), "model": row["model"], "gpu": row["gpu"],
                    "gpus": int(row["gpus"]), "seq_len": int(row["seq_len"]), "micro_batch": int(row["micro_batch"]),
                    "grad_accum": int(row["grad_accum"]), "sharding": row["sharding"], "mp_mode": row["mp_mode"],
                    "published": published, "predicted": round(got["tokens_per_s_per_gpu"], 1),
                    "ratio": round(got["tokens_per_s_per_gpu"] / published, 4)})
        if _checkpointed(row):
            without = predict(row, compiled[_key(row, "none")], models[row["gpu"]])["tokens_per_s_per_gpu"]
            out[-1].update(predicted_without_recompute=round(without, 1),
                           recompute_slowdown=round(without / got["tokens_per_s_per_gpu"], 4))
    ratios = [r["ratio"] for r in out]
    worst = max(out, key=lambda r: abs(r["ratio"] - 1)) if out else None
    return {
        "source": "mosaicml/llm-foundry@8c8dd48 scripts/train/benchmarking/README.md",
        "calibration": {gpu: {"rows": list(CALIBRATION[gpu][:1] if one_row else CALIBRATION[gpu]), "preset": PRESET_OF[gpu],
                              "matmul_efficiency": round(models[gpu].rates.matmul_efficiency, 4),
                              "attention_efficiency": round(models[gpu].rates.attention_efficiency, 4)}
                        for gpu in CALIBRATION},
        "rows": out,
        "median_ratio": statistics.median(ratios) if ratios else None,
        "median_abs_error": statistics.median(abs(r - 1) for r in ratios) if ratios else None,
        "worst": worst,
        "within_20pct": sum(abs(r - 1) <= 0.2 for r in ratios),
        "within_10pct": sum(abs(r - 1) <= 0.1 for r in ratios),
        "count": len(out),
    }


def check_checkpointed(rows: list[dict], **kwargs) -> dict:
    """`check` of checkpointed rows ([Note: the checkpointed rows]), with the rows that cannot be
    modelled (`not_modelled`), the five furthest from the published (`worst_rows`) and the
    median slowdown the simulator gives recompute."""
    if any(not _checkpointed(r) for r in rows):
        raise ValueError("check_checkpointed takes rows with activation checkpointing (load_rows(checkpointed=True))")
    result = check(rows, **kwargs)
    result["activations"] = 'fxzero.Activations(recompute="unit")'
    result["worst_rows"] = sorted(result["rows"], key=lambda r: -abs(r["ratio"] - 1))[:5]
    result["median_recompute_slowdown"] = (statistics.median(r["recompute_slowdown"] for r in result["rows"])
                                           if result["rows"] else None)
    result["not_modelled"] = not_modelled()
    return result


def markdown(result: dict) -> str:
    """The rows as a markdown table: published and predicted tokens/s per GPU (and, for
    checkpointed rows, the prediction without recompute)."""
    extra = any("predicted_without_recompute" in r for r in result["rows"])
    lines = ["| line | model | GPU | GPUs | seq | micro-batch | GA | sharding | published | predicted | ratio |"
             + (" no recompute |" if extra else ""),
             "| ---: | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |" + (" ---: |" if extra else "")]
    for r in result["rows"]:
        lines.append(f"| {r['source_line']} | {r['model']} | {r['gpu']} | {r['gpus']} | {r['seq_len']} | "
                     f"{r['micro_batch']} | {r['grad_accum']} | {r['sharding']} | {r['published']:.0f} | "
                     f"{r['predicted']:.0f} | {r['ratio']:.3f} |"
                     + (f" {r['predicted_without_recompute']:.0f} |" if extra else ""))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=str, default=None,
                        help="comma-separated source_line numbers of the table to check (default: all)")
    parser.add_argument("--cache", default=None, help="directory for compiled schedules (reruns skip compiling)")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--markdown", default=None, help="write the rows as a markdown table here (docs/simulator.md)")
    parser.add_argument("--one-row", action="store_true",
                        help="fit the matmul efficiency only (one row per GPU type), attention at issue 26's ratio")
    parser.add_argument("--checkpointed", action="store_true",
                        help="check the rows with activation checkpointing (recompute='unit'), on the efficiencies "
                             "fitted on the named rows without it")
    args = parser.parse_args(argv)
    rows = load_rows(checkpointed=args.checkpointed)
    if args.rows:
        wanted = {int(x) for x in args.rows.split(",")}
        unknown = wanted - {int(r["source_line"]) for r in rows}
        if unknown:
            other = {int(r["source_line"]) for r in load_rows(checkpointed=not args.checkpointed)}
            hint = (" (with activation checkpointing: add --checkpointed)" if unknown & other and not args.checkpointed
                    else " (without activation checkpointing: leave out --checkpointed)" if unknown & other else "")
            why = {r["source_line"]: r["reason"] for r in not_modelled()}
            named = "; ".join(f"row {line}: {why[line]}" for line in sorted(unknown) if line in why)
            parser.error(f"no checkable row at source_line {sorted(unknown)}{hint}{'; ' + named if named else ''}; "
                         f"see {TABLE}")
        rows = [r for r in rows if int(r["source_line"]) in wanted]
    if args.checkpointed:
        result = check_checkpointed(rows, cache=args.cache, one_row=args.one_row)
    else:
        result = check(rows, cache=args.cache, one_row=args.one_row)
    print(f"{'line':>4} {'model':>5} {'gpu':>9} {'gpus':>4} {'seq':>6} {'mb':>3} {'ga':>2} "
          f"{'published':>9} {'predicted':>9} {'ratio':>6}")
    for r in result["rows"]:
        print(f"{r['source_line']:>4} {r['model']:>5} {r['gpu']:>9} {r['gpus']:>4} {r['seq_len']:>6} "
              f"{r['micro_batch']:>3} {r['grad_accum']:>2} {r['published']:>9.0f} {r['predicted']:>9.0f} {r['ratio']:>6.3f}")
    for gpu, c in result["calibration"].items():
        print(f"calibrated {gpu} ({c['preset']}) on rows {c['rows']}: matmul efficiency {c['matmul_efficiency']}, "
              f"attention efficiency {c['attention_efficiency']}")
    if result["rows"]:
        w = result["worst"]
        print(f"median predicted/published {result['median_ratio']:.3f}, median |error| "
              f"{result['median_abs_error']:.3f}; worst {w['ratio']:.3f} (row {w['source_line']}: {w['model']} "
              f"{w['gpu']} x{w['gpus']} seq {w['seq_len']}); within 20%: {result['within_20pct']}/{result['count']}, "
              f"within 10%: {result['within_10pct']}/{result['count']}")
    if args.checkpointed:
        if result["rows"]:
            print(f"recompute ({result['activations']}) makes a row {result['median_recompute_slowdown']:.3f}x slower "
                  f"in the median; furthest from the published: "
                  + ", ".join(f"row {r['source_line']} {r['ratio']:.3f}" for r in result["worst_rows"]))
        for r in result["not_modelled"]:
            print(f"not modelled: row {r['source_line']} ({r['model']} {r['gpu']} x{r['gpus']} seq {r['seq_len']}): "
                  f"{r['reason']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
