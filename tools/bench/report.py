"""From the ranks' raw measurements to the benchmark's JSON lines.

Three kinds of line, each a JSON object with an "event" key:

- "run": one system, one round: step times, losses, peak RSS per rank, traffic per step.
- "system": one system over all its rounds: the figures to quote.
- "summary": the issue's targets as ratios for each fxzero system, and the loss agreement.
  An fxzero system's ratios are taken against the systems of its precision: an fp32 one's
  against fsdp2 and ds-zero3, a bf16 one's (fxzero-stage3-bf16) against fsdp2-bf16,
  ds-zero3-bf16 and floor-bf16 (the no-communication floor), keys ending in "_bf16".
  An offloaded fxzero system is also compared with fxzero's device-resident step
  (`offload_step_vs_device`; the target holds on the 25M model) and with DeepSpeed at the same
  placement (`steps_per_s_vs_ds_same_placement`; the target holds where DeepSpeed's NVMe offload
  is I/O bound, the ~1B model).
  Systems that recompute activations (fxzero's recompute policies, the peers' checkpointing)
  have their own bars and loss checks, in the summary's "activations" (tools/bench/activations.py);
  an fxzero one gets no step or RSS ratio against the resident peers here.

A step's time is the slowest rank's (a step is done when every rank is); the median is over
every timed step of every round, pooled. Losses are averaged over ranks (each rank trains on
its own micro-batch), step by step.
"""

from __future__ import annotations

import statistics
from typing import Any, Optional

from tools.bench.activations import activation_summary
from tools.bench.commcount import COUNTED_BY

__all__ = ["run_line", "system_line", "summary_line"]

MB = 1e6
# Loss agreement, relative to DDP's loss: every system trains the same fp32 model on the same
# data, so only the order of reductions (bucketing, sharding, a fused Adam) differs. Measured:
# up to 6e-8 on the 25M model, 3.4e-6 on GPT-2's shape (DeepSpeed, loss ~104 at init).
LOSS_TOLERANCE = 1e-5
# bf16 systems, relative to ddp-bf16's loss: the same model and data, but each system rounds to
# bf16 at its own places (autocast casts per op, FSDP2 and fxzero hold bf16 copies of the
# parameters, DeepSpeed also reduces its gradients in bf16), and a bf16 rounding is 2^-9 ~ 2e-3
# relative. ANCHORS.md: the bf16 systems' losses were within 0.5% of each other after 8 steps.
LOSS_TOLERANCE_BF16 = 2e-2
LOSS_REFERENCES = {"fp32": "ddp", "bf16": "ddp-bf16"}
"""A system's precision -> the system whose losses its losses are compared with."""
TARGETS = {"step_vs_fsdp2": 0.9, "step_vs_ds_zero3": 0.8, "peak_rss_vs_fsdp2": 1.0, "comm_vs_3phi": 0.01, "predicted_vs_measured": 0.2,
           "offload_step_vs_device": 1.2, "steps_per_s_vs_ds_same_placement": 2.0,
           "step_vs_fsdp2_bf16": 0.8, "step_vs_ds_zero3_bf16": 0.75, "step_vs_floor_bf16": 1.1,
           "peak_rss_vs_fsdp2_bf16": 1.0}
# An fxzero system's ratios (key, reference system, figure), by the system's precision; each is
# "met" when at most TARGETS[key]. Step ratios also come over quiet runs only (key + "_quiet").
RATIOS = {
    "fp32": (
        ("step_vs_fsdp2", "fsdp2", "median_step_s"),
        ("step_vs_ds_zero3", "ds-zero3", "median_step_s"),
        ("peak_rss_vs_fsdp2", "fsdp2", "peak_rss_mb"),
    ),
    "bf16": (
        ("step_vs_fsdp2_bf16", "fsdp2-bf16", "median_step_s"),
        ("step_vs_ds_zero3_bf16", "ds-zero3-bf16", "median_step_s"),
        ("step_vs_floor_bf16", "floor-bf16", "median_step_s"),
        ("peak_rss_vs_fsdp2_bf16", "fsdp2-bf16", "peak_rss_mb"),
    ),
}
# fxzero's device-resident systems, in order of preference, as the reference of an offloaded one
# (the offload systems initialize from the seed, as fxzero-stage3-meta does).
DEVICE_REFERENCES = ("fxzero-stage3-meta", "fxzero-stage3")


RUN_KEYS = (
    "init", "num_params", "memory_report", "engine_io", "predicted_step_s", "predicted_with", "predicted_detail",
    "predicted_error", "deepspeed", "offload", "optimizer", "zero_optimization", "bf16", "autocast", "mp_policy",
    "mixed_precision", "activations_policy", "activation_checkpointing", "block_forwards_per_step",
)
"""What a run line copies from rank 0's result as is, where the system reports it."""
SYSTEM_KEYS = tuple(k for k in RUN_KEYS if k not in ("predicted_step_s", "predicted_error"))
"""What a system line copies from its first kept run line as is."""


def _median(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def _per_step(d: dict[str, dict[str, int]], steps: int) -> dict[str, dict[str, float]]:
    return {k: {f: v / steps for f, v in t.items()} for k, t in d.items()}


def run_line(name: str, round_: int, result: dict[str, Any], steps: int, warmup: int) -> dict[str, Any]:
    """The "run" line of one system's run (or its failure)."""
    line: dict[str, Any] = {"event": "run", "system": name, "round": round_, "wall_s": round(result["wall_s"], 2)}
    for key in ("background_cores", "ranks_cpu_s", "waited_for_quiet_s"):
        if key in result:
            line[key] = result[key]
    if "error" in result:
        line.update(ok=False, error=result["error"][-4000:], logs=result.get("logs"))
        return line
    ranks = result["ranks"]
    r0 = ranks[0]
    per_step = [max(r["step_times_s"][i] for r in ranks) for i in range(len(r0["step_times_s"]))]
    losses = [statistics.fmean(r["losses"][i] for r in ranks) for i in range(len(r0["losses"]))]
    timed = per_step[warmup:]
    line.update(
        ok=True,
        median_step_s=_median(timed),
        step_times_s=timed,
        warmup_step_s=per_step[:warmup],
        losses=losses,
        losses_per_rank=[r["losses"] for r in ranks],
        final_loss=losses[-1],
        peak_rss_mb_per_rank=[r["peak_rss_bytes"] / MB for r in ranks],
        rss_after_setup_mb_per_rank=[r["rss_after_setup_bytes"] / MB for r in ranks],
        setup_s=max(r["setup_s"] for r in ranks),
        comm=r0["comm"],
        comm_counted_by=r0.get("comm_counted_by", COUNTED_BY),
        loopback_bytes_per_step=r0.get("loopback_bytes_per_step"),
    )
    if r0.get("checkpointed_blocks"):  # a peer's checkpointing: 2.0 when every block recomputed
        line["block_forwards_per_step"] = r0["checkpointed_block_forwards"] / (r0["checkpointed_blocks"] * len(r0["losses"]))
    peaks = [r.get("memory_report", {}).get("activations_peak") for r in ranks]
    if all(p is not None for p in peaks):  # fxzero: the bytes its forwards kept, at most
        line["activations_peak_bytes_per_rank"] = peaks
    if "engine_comm" in r0:  # fxzero: its own counters are the primary figure
        engine = _per_step(r0["engine_comm"], steps)
        line["engine_comm_per_step"] = engine
        line["engine_comm_elements_per_step"] = sum(t["elements"] for t in engine.values())
        line["engine_comm_bytes_per_step"] = sum(t["bytes"] for t in engine.values())
        line["engine_comm_counted_by"] = r0["engine_comm_counted_by"]
    for key in RUN_KEYS:
        if key in r0:
            line[key] = r0[key]
    return line


def system_line(
    name: str,
    description: str,
    runs: list[dict[str, Any]],
    reference: Optional[dict[str, Any]],
    quiet_cores: Optional[float] = None,
    *,
    reference_name: str = "ddp",
    precision: str = "fp32",
    trains_alike: bool = True,
    activations: str = "none",
    resident: Optional[str] = None,
) -> dict[str, Any]:
    """The "system" line: `runs` are this system's kept "run" lines; `reference` is the line of
    its loss reference, `reference_name` (DDP's for fp32, ddp-bf16's for bf16: LOSS_REFERENCES).

    The losses' deviations from the reference's, step by step, are `loss_max_{abs,rel}_dev_vs_X`
    (X: "ddp", "ddp_bf16"); for a system whose ranks do not train one model together
    (`trains_alike` False: the floor) only the first step's, before any update, as
    `loss_first_step_{abs,rel}_dev_vs_X`.

    With `quiet_cores`, also the median over the runs during which other processes kept fewer
    cores than that busy (`median_step_s_quiet`), next to the median over all kept runs.

    `activations` and `resident` are the system table's (`systems.System`): what the system does
    with activations and which system keeps them all; the summary's "activations" part reads them.
    """
    ok = [r for r in runs if r["ok"]]
    line: dict[str, Any] = {"event": "system", "system": name, "description": description, "precision": precision, "rounds_ok": len(ok), "rounds_failed": len(runs) - len(ok)}
    line["activations"] = activations
    if resident is not None:
        line["resident"] = resident
    if not ok:
        line["error"] = runs[0]["error"] if runs else "no run"
        return line
    times = [t for r in ok for t in r["step_times_s"]]
    world = len(ok[0]["peak_rss_mb_per_rank"])
    rss = [max(r["peak_rss_mb_per_rank"][i] for r in ok) for i in range(world)]
    first = ok[0]
    line.update(
        median_step_s=_median(times),
        round_median_step_s=[r["median_step_s"] for r in ok],
        step_times_s=times,
        peak_rss_mb_per_rank=rss,
        peak_rss_mb=max(rss),
        rss_after_setup_mb_per_rank=[max(r["rss_after_setup_mb_per_rank"][i] for r in ok) for i in range(world)],
        comm_elements_per_step=first["comm"]["elements"],
        comm_bytes_per_step=first["comm"]["bytes"],
        comm_volume_elements_per_step=first["comm"]["volume_elements"],
        comm_by_kind=first["comm"]["by_kind"],
        # The figures above are round 1's; a compiler that picks collectives per run (fxzero's
        # cost model) may move different volumes in other rounds, so every round's is listed.
        comm_volume_elements_per_round=[r["comm"]["volume_elements"] for r in ok],
        comm_counted_by=first["comm_counted_by"],
        loopback_bytes_per_step=_median([r["loopback_bytes_per_step"] for r in ok if r.get("loopback_bytes_per_step") is not None]),
        final_loss=first["final_loss"],
        losses=first["losses"],
        losses_per_rank=first.get("losses_per_rank"),
        background_cores_per_round=[r.get("background_cores") for r in ok],
        loss_max_dev_across_rounds=max(
            (abs(a - b) for r in ok[1:] for a, b in zip(r["losses"], first["losses"])), default=0.0
        ),
    )
    if all("activations_peak_bytes_per_rank" in r for r in ok):
        per_rank = [max(r["activations_peak_bytes_per_rank"][i] for r in ok) for i in range(world)]
        line["activations_peak_bytes_per_rank"] = per_rank
        line["activations_peak_bytes"] = max(per_rank)
    if "engine_comm_elements_per_step" in first:
        # fxzero's own counters are the figure; the wrapped collectives stay as the cross-check.
        line["comm_elements_per_step_wrapped"] = line["comm_elements_per_step"]
        line["comm_elements_per_step"] = first["engine_comm_elements_per_step"]
        line["comm_bytes_per_step"] = first["engine_comm_bytes_per_step"]
        line["comm_by_kind"] = first["engine_comm_per_step"]
        line["comm_counted_by"] = first["engine_comm_counted_by"] + "; cross-check: " + first["comm_counted_by"]
    if quiet_cores is not None:
        quiet = [r for r in ok if r.get("background_cores", 0.0) <= quiet_cores]
        line["quiet_rounds"] = len(quiet)
        line["median_step_s_quiet"] = _median([t for r in quiet for t in r["step_times_s"]])
    predicted = [r["predicted_step_s"] for r in ok if "predicted_step_s" in r]
    if predicted:
        line["predicted_step_s"] = _median(predicted)
        line["predicted_vs_measured"] = line["predicted_step_s"] / line["median_step_s"]
    errors = [r["predicted_error"] for r in ok if "predicted_error" in r]
    if errors:
        line["predicted_error"] = errors[0]
    for key in SYSTEM_KEYS:
        if key in first:
            line[key] = first[key]
    if reference is not None and reference.get("losses"):
        pairs = list(zip(line["losses"], reference["losses"]))
        prefix = "loss_max" if trains_alike else "loss_first_step"
        if not trains_alike:
            pairs = pairs[:1]
        suffix = _loss_key(reference_name)
        line["loss_reference"] = reference_name
        line[f"{prefix}_abs_dev_vs_{suffix}"] = max(abs(a - b) for a, b in pairs)
        line[f"{prefix}_rel_dev_vs_{suffix}"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)
    return line


def _loss_key(reference_name: str) -> str:
    """The suffix of a system line's loss deviation keys: "ddp", "ddp_bf16"."""
    return reference_name.replace("-", "_")


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def summary_line(systems: dict[str, dict[str, Any]], num_params: int, model: str, unavailable: dict[str, str]) -> dict[str, Any]:
    """The issue's targets as ratios for each fxzero system; reported, never asserted.

    A system line without "precision" (an older output's) counts as fp32; one of a precision
    without ratios of its own (`RATIOS`) gets the traffic ratios only.
    """
    targets: dict[str, Any] = {}
    for name, s in systems.items():
        if not name.startswith("fxzero") or "median_step_s" not in s:
            continue
        precision = s.get("precision", "fp32")
        # A recomputing fxzero system's bars are against the checkpointed peers and its own
        # resident run (the summary's "activations"), not against the resident peers.
        recomputes = s.get("activations", "none") != "none"
        ratios = () if recomputes else RATIOS.get(precision, ())
        t: dict[str, Any] = {}
        if precision != "fp32":
            t["precision"] = precision
        for key, ref, figure in ratios:
            t[key] = _ratio(s[figure], systems.get(ref, {}).get(figure))
        t["comm_vs_3phi"] = s["comm_elements_per_step"] / (3 * num_params)
        # The same traffic as the wrapped collectives saw it, all-reduce weighted x2: differs
        # from the line above when the engine replaces a reduce-scatter by an all-reduce.
        t["comm_volume_vs_3phi"] = s["comm_volume_elements_per_step"] / (3 * num_params)
        if s.get("median_step_s_quiet") is not None:
            # The same ratios over quiet runs only (see system_line); `met` uses all kept runs.
            for key, ref, figure in ratios:
                if figure == "median_step_s":
                    t[key + "_quiet"] = _ratio(s["median_step_s_quiet"], systems.get(ref, {}).get("median_step_s_quiet"))
        if "predicted_vs_measured" in s:
            t["predicted_vs_measured"] = s["predicted_vs_measured"]
        t["met"] = {key: _le(t[key], TARGETS[key]) for key, _, _ in ratios}
        t["met"]["comm_vs_3phi"] = abs(t["comm_vs_3phi"] - 1) <= TARGETS["comm_vs_3phi"]
        if "predicted_vs_measured" in t:
            t["met"]["predicted_vs_measured"] = abs(t["predicted_vs_measured"] - 1) <= TARGETS["predicted_vs_measured"]
        if s.get("offload") in ("cpu", "nvme"):
            t.update(_offload_ratios(name, s, systems))
            t["met"]["offload_step_vs_device"] = _le(t["offload_step_vs_device"], TARGETS["offload_step_vs_device"])
            speedup = t["steps_per_s_vs_ds_same_placement"]
            t["met"]["steps_per_s_vs_ds_same_placement"] = (
                None if speedup is None else speedup >= TARGETS["steps_per_s_vs_ds_same_placement"]
            )
        targets[name] = t
    def field(key: str) -> dict[str, float]:
        return {n: s[key] for n, s in systems.items() if key in s}

    devs, rel = field("loss_max_abs_dev_vs_ddp"), field("loss_max_rel_dev_vs_ddp")
    devs_bf16, rel_bf16 = field("loss_max_abs_dev_vs_ddp_bf16"), field("loss_max_rel_dev_vs_ddp_bf16")
    first, first_bf16 = field("loss_first_step_rel_dev_vs_ddp"), field("loss_first_step_rel_dev_vs_ddp_bf16")
    agree_fp32 = _all_within({**rel, **first}, LOSS_TOLERANCE)
    agree_bf16 = _all_within({**rel_bf16, **first_bf16}, LOSS_TOLERANCE_BF16)
    agreements = [a for a in (agree_fp32, agree_bf16) if a is not None]
    out = {
        "event": "summary",
        "model": model,
        "num_params": num_params,
        "targets": {
            "step_vs_fsdp2": "<= 0.9",
            "step_vs_ds_zero3": "<= 0.8",
            "peak_rss_vs_fsdp2": "<= 1.0",
            "comm_vs_3phi": "within 1% of 1.0",
            "predicted_vs_measured": "within 20% of 1.0",
            "offload_step_vs_device": "<= 1.2 (offloaded fxzero / device-resident fxzero; 25M model)",
            "steps_per_s_vs_ds_same_placement": ">= 2.0 (DeepSpeed's step / fxzero's, same offload; ~1B model)",
            "step_vs_fsdp2_bf16": "<= 0.8 (bf16 fxzero / fsdp2-bf16)",
            "step_vs_ds_zero3_bf16": "<= 0.75 (bf16 fxzero / ds-zero3-bf16)",
            "step_vs_floor_bf16": "<= 1.1 (bf16 fxzero / floor-bf16, the no-communication floor)",
            "peak_rss_vs_fsdp2_bf16": "<= 1.0 (bf16 fxzero / fsdp2-bf16)",
        },
        "fxzero": targets,
        "median_step_s": {n: s.get("median_step_s") for n, s in systems.items()},
        "median_step_s_quiet": {n: s.get("median_step_s_quiet") for n, s in systems.items()},
        "peak_rss_mb": {n: s.get("peak_rss_mb") for n, s in systems.items()},
        "comm_elements_per_step": {n: s.get("comm_elements_per_step") for n, s in systems.items()},
        "loss_max_abs_dev_vs_ddp": devs,
        "max_loss_dev_vs_ddp": max(devs.values(), default=None),
        "loss_max_rel_dev_vs_ddp": rel,
        # bf16 systems against ddp-bf16, at LOSS_TOLERANCE_BF16 (they are not compared with fp32 DDP)
        "loss_max_abs_dev_vs_ddp_bf16": devs_bf16,
        "loss_max_rel_dev_vs_ddp_bf16": rel_bf16,
        # systems whose ranks do not train one model together (the floors): the first step only
        "loss_first_step_rel_dev_vs_ddp": first,
        "loss_first_step_rel_dev_vs_ddp_bf16": first_bf16,
        "losses_agree": all(agreements) if agreements else None,
        "losses_agree_fp32": agree_fp32,
        "losses_agree_bf16": agree_bf16,
        "loss_tolerance": f"{LOSS_TOLERANCE:g} relative to DDP's loss, at every step",
        "loss_tolerance_bf16": (
            f"{LOSS_TOLERANCE_BF16:g} relative to ddp-bf16's loss, at every step, for the bf16 systems; "
            "losses_agree: every system within its precision's tolerance (a floor: its first step only)"
        ),
        "unavailable": unavailable,
        "failed": sorted(n for n, s in systems.items() if "median_step_s" not in s),
    }
    activations = activation_summary(systems, LOSS_TOLERANCE)
    if activations is not None:
        out["activations"] = activations
    return out


def _offload_ratios(name: str, s: dict[str, Any], systems: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """An offloaded fxzero system against fxzero on the device and DeepSpeed at its placement."""
    device_name = next((n for n in DEVICE_REFERENCES if systems.get(n, {}).get("median_step_s")), None)
    device = systems[device_name]["median_step_s"] if device_name else None
    ds_name = f"ds-zero3-offload-{s['offload']}"
    ds_step = systems.get(ds_name, {}).get("median_step_s")
    return {
        "offload_step_vs_device": _ratio(s["median_step_s"], device),
        "offload_device_reference": device_name,
        "steps_per_s_vs_ds_same_placement": _ratio(ds_step, s["median_step_s"]),
        "ds_same_placement": ds_name if ds_step else None,
    }


def _all_within(devs: dict[str, float], tolerance: float) -> Optional[bool]:
    return all(d <= tolerance for d in devs.values()) if devs else None


def _le(value: Optional[float], bound: float) -> Optional[bool]:
    return None if value is None else value <= bound
