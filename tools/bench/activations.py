"""The activation side by side (issue 23, `--systems activations`): its bars, ratios and losses.

The issue's bars, each a ratio of two systems' figures, "pass" when at most the bar (never
lowered here: they are the issue's):

    fxzero-stage3-unit      / fsdp2-ckpt      step <= 0.9    peak RSS <= 1.0
    fxzero-stage3-unit      / ds-zero3-ckpt   step <= 0.8    peak RSS <= 1.0
    fxzero-stage3-unit      / fxzero-stage3   step <= 1.30
    fxzero-stage3-selective / fxzero-stage3   step <= 1.05   activation bytes <= 0.35

and the losses: every fxzero policy's equal to the resident run's bit for bit, per rank and
step (recompute changes where a value is computed, not its arithmetic); each checkpointed peer's
within `report.LOSS_TOLERANCE` of its own resident run's (its checkpoint recomputes the same ops,
but a peer owes us no bit-exactness).

Beside the bars, what checkpointing cost each system (`COSTS`: step, peak RSS and, for fxzero,
activation bytes against its resident run; fxzero's all-gather bytes, which recompute must not
change), reported without a bar, and fxzero-stage3-unit-attention (`keep_attention=True`: each
unit keeps its attention's outputs too) against the resident run and the checkpointed peers:
the bars are the plain unit's, which recomputes what the peers' checkpoints recompute. Activation bytes are fxzero's `memory_report()
["activations_peak"]` (the storages the forward kept for the backward, at most over the run),
the most over ranks; the peers have no such counter.

A bar whose systems did not both run is "n/a", naming what is missing: never a pass. One more
line checks that each peer's checkpointing took effect: every wrapped block's forward ran twice
per step (`block_forwards_per_step`, counted by `common.CheckpointedBlock`); a checkpoint that
silently does nothing (DeepSpeed#5704) would otherwise look like a cheap one.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["BARS", "COSTS", "activation_summary", "bar_lines"]

UNIT, SELECTIVE, RESIDENT = "fxzero-stage3-unit", "fxzero-stage3-selective", "fxzero-stage3"
UNIT_ATTENTION = "fxzero-stage3-unit-attention"

BARS: tuple[tuple[str, str, str, str, float, str], ...] = (
    # key, system, reference, figure, bar, what
    ("unit_step_vs_fsdp2_ckpt", UNIT, "fsdp2-ckpt", "median_step_s", 0.9,
     "fxzero unit step / FSDP2 + torch.utils.checkpoint step"),
    ("unit_step_vs_ds_zero3_ckpt", UNIT, "ds-zero3-ckpt", "median_step_s", 0.8,
     "fxzero unit step / DeepSpeed ZeRO-3 + activation checkpointing step"),
    ("unit_peak_rss_vs_fsdp2_ckpt", UNIT, "fsdp2-ckpt", "peak_rss_mb", 1.0,
     "fxzero unit peak RSS / FSDP2 + torch.utils.checkpoint peak RSS"),
    ("unit_peak_rss_vs_ds_zero3_ckpt", UNIT, "ds-zero3-ckpt", "peak_rss_mb", 1.0,
     "fxzero unit peak RSS / DeepSpeed ZeRO-3 + activation checkpointing peak RSS"),
    ("unit_step_vs_resident", UNIT, RESIDENT, "median_step_s", 1.30,
     "fxzero unit step / fxzero resident step"),
    ("selective_step_vs_resident", SELECTIVE, RESIDENT, "median_step_s", 1.05,
     "fxzero selective step / fxzero resident step"),
    ("selective_activations_vs_resident", SELECTIVE, RESIDENT, "activations_peak_bytes", 0.35,
     "fxzero selective activation bytes / fxzero resident activation bytes"),
)
"""The issue's bars: (key, system, reference, figure, bar, what); pass when value <= bar."""

COSTS: tuple[tuple[str, str, str, str], ...] = (
    # key, system, reference, figure: what recomputing cost (or saved) each system
    ("unit_peak_rss_vs_resident", UNIT, RESIDENT, "peak_rss_mb"),
    ("unit_activations_vs_resident", UNIT, RESIDENT, "activations_peak_bytes"),
    ("unit_all_gather_bytes_vs_resident", UNIT, RESIDENT, "all_gather_bytes_per_step"),
    ("selective_peak_rss_vs_resident", SELECTIVE, RESIDENT, "peak_rss_mb"),
    ("selective_all_gather_bytes_vs_resident", SELECTIVE, RESIDENT, "all_gather_bytes_per_step"),
    ("selective_peak_rss_vs_fsdp2_ckpt", SELECTIVE, "fsdp2-ckpt", "peak_rss_mb"),
    ("selective_peak_rss_vs_ds_zero3_ckpt", SELECTIVE, "ds-zero3-ckpt", "peak_rss_mb"),
    ("unit_attention_step_vs_resident", UNIT_ATTENTION, RESIDENT, "median_step_s"),
    ("unit_attention_step_vs_fsdp2_ckpt", UNIT_ATTENTION, "fsdp2-ckpt", "median_step_s"),
    ("unit_attention_step_vs_ds_zero3_ckpt", UNIT_ATTENTION, "ds-zero3-ckpt", "median_step_s"),
    ("unit_attention_peak_rss_vs_fsdp2_ckpt", UNIT_ATTENTION, "fsdp2-ckpt", "peak_rss_mb"),
    ("unit_attention_peak_rss_vs_ds_zero3_ckpt", UNIT_ATTENTION, "ds-zero3-ckpt", "peak_rss_mb"),
    ("unit_attention_activations_vs_resident", UNIT_ATTENTION, RESIDENT, "activations_peak_bytes"),
    ("fsdp2_ckpt_step_vs_fsdp2", "fsdp2-ckpt", "fsdp2", "median_step_s"),
    ("fsdp2_ckpt_peak_rss_vs_fsdp2", "fsdp2-ckpt", "fsdp2", "peak_rss_mb"),
    ("ds_zero3_ckpt_step_vs_ds_zero3", "ds-zero3-ckpt", "ds-zero3", "median_step_s"),
    ("ds_zero3_ckpt_peak_rss_vs_ds_zero3", "ds-zero3-ckpt", "ds-zero3", "peak_rss_mb"),
)
"""Reported beside the bars, without one: (key, system, reference, figure)."""


def _figure(line: Optional[dict[str, Any]], figure: str) -> Optional[float]:
    if not line:
        return None
    if figure == "all_gather_bytes_per_step":  # fxzero: its engine's own count, per step
        return line.get("comm_by_kind", {}).get("all_gather", {}).get("bytes")
    return line.get(figure)


def _ratio(systems: dict[str, dict[str, Any]], name: str, ref: str, figure: str) -> tuple[Optional[float], str]:
    """The ratio and, when it cannot be taken, why ("" when it can)."""
    missing = [n for n in (name, ref) if _figure(systems.get(n), figure) is None]
    if missing:
        return None, f"no {figure} for {', '.join(missing)}"
    den = _figure(systems[ref], figure)
    if not den:
        return None, f"{ref}'s {figure} is 0"
    return _figure(systems[name], figure) / den, ""


def _losses(systems: dict[str, dict[str, Any]], tolerance: float) -> dict[str, Any]:
    """Each recomputing system's losses against its resident twin's, step by step (per rank
    where the lines have them, else the rank mean)."""
    out: dict[str, Any] = {"max_abs_dev_vs_resident": {}, "max_rel_dev_vs_resident": {}, "equal_to_resident": {}}
    for name, line in systems.items():
        resident = systems.get(line.get("resident") or "")
        if not resident or not line.get("losses") or not resident.get("losses"):
            continue
        key = "losses_per_rank" if line.get("losses_per_rank") and resident.get("losses_per_rank") else "losses"
        ours, theirs = line[key], resident[key]
        if key == "losses_per_rank":  # rank by rank, flattened
            ours = [x for rank in ours for x in rank]
            theirs = [x for rank in theirs for x in rank]
        pairs = list(zip(ours, theirs))
        out["equal_to_resident"][name] = len(ours) == len(theirs) and all(a == b for a, b in pairs)
        out["max_abs_dev_vs_resident"][name] = max((abs(a - b) for a, b in pairs), default=None)
        out["max_rel_dev_vs_resident"][name] = max((abs(a - b) / max(abs(b), 1e-12) for a, b in pairs), default=None)
    fx = [n for n in out["equal_to_resident"] if systems[n].get("activations") not in ("none", "checkpoint")]
    peers = [n for n in out["equal_to_resident"] if systems[n].get("activations") == "checkpoint"]
    out["fxzero_policies_equal_bitwise"] = all(out["equal_to_resident"][n] for n in fx) if fx else None
    out["peers_within_tolerance_of_resident"] = (
        all(out["max_rel_dev_vs_resident"][n] <= tolerance for n in peers) if peers else None
    )
    out["tolerance"] = f"fxzero: equal bit for bit (per rank, every step); peers: {tolerance:g} relative"
    return out


def activation_summary(systems: dict[str, dict[str, Any]], tolerance: float) -> Optional[dict[str, Any]]:
    """The "activations" part of the summary line, or None when no system recomputes.

    `systems`: the system lines by name (with "activations" and "resident" from the table).
    """
    if not any(s.get("activations", "none") != "none" for s in systems.values()):
        return None
    bars, ratios, met = [], {}, {}
    for key, name, ref, figure, bar, what in BARS:
        value, why = _ratio(systems, name, ref, figure)
        ratios[key] = value
        met[key] = None if value is None else value <= bar
        result = "n/a: " + why if value is None else ("pass" if value <= bar else "miss")
        bars.append({"key": key, "what": what, "value": value, "bar": f"<= {bar:g}", "result": result})
        if figure == "median_step_s":  # over quiet runs only, as report.summary_line gives them
            ratios[key + "_quiet"] = _ratio(systems, name, ref, "median_step_s_quiet")[0]
    losses = _losses(systems, tolerance)
    for key, value, what in (
        ("fxzero_losses_equal", losses["fxzero_policies_equal_bitwise"],
         "fxzero policies' losses equal to the resident run's, bit for bit"),
        ("peer_losses_within_tolerance", losses["peers_within_tolerance_of_resident"],
         f"checkpointed peers' losses within {tolerance:g} of their resident runs'"),
    ):
        met[key] = value
        result = "n/a: no such pair ran" if value is None else ("pass" if value else "miss")
        bars.append({"key": key, "what": what, "value": value, "bar": "equal" if "equal" in key else "within", "result": result})
    # A peer's checkpoint that did nothing (DeepSpeed#5704) would pass every bar above vacuously.
    counts = {n: s.get("block_forwards_per_step") for n, s in systems.items() if s.get("activations") == "checkpoint"}
    recomputed = all(c == 2.0 for c in counts.values()) if counts else None
    met["peers_recomputed"] = recomputed
    bars.append({"key": "peers_recomputed", "value": counts, "bar": "2.0 each",
                 "what": "checkpointed peers ran each block's forward twice per step (forward, recompute)",
                 "result": "n/a: no checkpointed peer ran" if recomputed is None else ("pass" if recomputed else "miss")})
    costs = {key: _ratio(systems, name, ref, figure)[0] for key, name, ref, figure in COSTS}
    activation_bytes = {n: s["activations_peak_bytes"] for n, s in systems.items() if s.get("activations_peak_bytes") is not None}
    return {"bars": bars, "ratios": ratios, "met": met, "costs": costs, "losses": losses,
            "activations_peak_bytes": activation_bytes}


def bar_lines(summary: dict[str, Any]) -> list[str]:
    """One readable line per bar of a summary line's "activations" part (none without it)."""
    part = summary.get("activations")
    if not part:
        return []
    lines = []
    for bar in part["bars"]:
        value = bar["value"]
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        lines.append(f"[{bar['result']}] {bar['what']}: {shown} (bar {bar['bar']})")
    return lines
