"""A PNG of per-rank memory over one step: what is resident, stacked, instruction by instruction.

Layers, bottom to top: parameter storage and optimizer states (constant), gradients,
activations, and gathered parameter buffers; the top edge is resident memory. The x axis is the
instruction index across the forward, backward and step programs, which are marked. Drawn with
matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

from fxzero.viz.fmt import human_bytes
from fxzero.viz.series import memory_series

__all__ = ["memory_plot"]

COLOURS = {"states": "#bab0ac", "gradients": "#f28e2b", "activations": "#76b7b2", "gathered": "#2f6db5"}


def _scale(peak: float) -> tuple[float, str]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if peak >= scale:
            return scale, unit
    return 1, "B"


def memory_plot(art, path: str, *, title: str | None = None) -> None:
    """Write the plot of `art` (fxzero.artifacts.Artifacts) to `path` as PNG."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    mem = memory_series(art)
    n = len(mem.points)
    peak, at = mem.peak()
    scale, unit = _scale(peak)
    xs = list(range(n))
    layers = [
        ("params + optimizer states", [mem.states / scale] * n, COLOURS["states"]),
        ("gradients", [g / scale for g in mem.gradients], COLOURS["gradients"]),
        ("activations", [a / scale for a in mem.activations], COLOURS["activations"]),
        ("gathered params", [g / scale for g in mem.gathered], COLOURS["gathered"]),
    ]
    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=100)
    ax.stackplot(xs, *[values for _, values, _ in layers], labels=[name for name, _, _ in layers],
                 colors=[c for _, _, c in layers], step="post", linewidth=0)
    start = 0
    for program in art.schedule.programs:
        count = len(program.instructions)
        if count == 0:
            continue
        if start:
            ax.axvline(start - 0.5, color="#444444", linewidth=0.8, linestyle="--")
        ax.text(start + count / 2, 1.0, program.name, transform=ax.get_xaxis_transform(),
                ha="center", va="bottom", fontsize=9)
        start += count
    if at >= 0:
        ax.annotate(f"peak {human_bytes(peak)}", xy=(at, peak / scale), xytext=(0, 6),
                    textcoords="offset points", ha="center", fontsize=8)
    s = art.schedule
    ax.set_title(title or f"{art.manifest.get('model')}: ZeRO-{s.stage} on {s.world_size} ranks, memory of one rank over a step",
                 fontsize=10, pad=16)
    ax.set_xlabel("instruction (in the order the runtime runs them)")
    ax.set_ylabel(unit)
    ax.set_xlim(0, max(n - 1, 1))
    ax.set_ylim(0, peak / scale * 1.15 if peak else 1)
    ax.legend(loc="upper left", fontsize=8, frameon=False)
    ax.grid(axis="y", linewidth=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
