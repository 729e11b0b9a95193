"""Per-instruction memory series of a recorded step, shared by the table, trace and plot."""

from __future__ import annotations

import dataclasses

__all__ = ["MemorySeries", "memory_series"]


@dataclasses.dataclass(frozen=True)
class MemorySeries:
    """Bytes per rank at each instruction of the step (forward, backward, step in order)."""

    points: tuple[tuple[str, int], ...]
    """(program, index) of each point."""
    gathered: tuple[int, ...]
    """Gathered parameter buffers (the schedule's own timeline)."""
    activations: tuple[int, ...]
    gradients: tuple[int, ...]
    states: int
    """Parameter storage + optimizer states + buffers, constant over the step."""

    def resident(self, i: int) -> int:
        return self.states + self.gathered[i] + self.activations[i] + self.gradients[i]

    def peak(self) -> tuple[int, int]:
        """(bytes, point index) of the highest resident memory."""
        if not self.points:
            return self.states, -1
        i = max(range(len(self.points)), key=self.resident)
        return self.resident(i), i


def memory_series(art) -> MemorySeries:
    """The memory series of `art` (fxzero.artifacts.Artifacts)."""
    ms = art.memory["model_states"]
    states = int(ms["params"] + ms["optimizer"] + ms.get("buffers", 0))
    points, gathered, acts, grads = [], [], [], []
    for p in art.schedule.programs:
        rec = art.memory["programs"].get(p.name, {})
        n = len(p.instructions)
        a = rec.get("activations") or [0] * n
        g = rec.get("gradients") or [0] * n
        for i in range(n):
            points.append((p.name, i))
            gathered.append(p.gathered_bytes[i])
            acts.append(a[i])
            grads.append(g[i])
    return MemorySeries(tuple(points), tuple(gathered), tuple(acts), tuple(grads), states)
