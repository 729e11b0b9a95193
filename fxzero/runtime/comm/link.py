"""Link emulation: collectives complete as if the link had a given bandwidth and latency.

[Note: link emulation]
With `LinkEmulation(bandwidth, latency)`, every collective is given a deadline as if it ran on
that link, one after another (the link is busy until the previous collective's deadline): the
transfer itself happens at loopback speed, and `Pending.wait()` then sleeps until the deadline.
The waiting rank sleeps rather than spins, so compute elsewhere (the other rank's, or this
rank's work issued before the wait) proceeds: overlap can be measured on a CPU box.
"""

from __future__ import annotations

import time

from fxzero.config import LinkEmulation

__all__ = ["EmulatedLink"]


class EmulatedLink:
    """See [Note: link emulation]."""

    def __init__(self, link: LinkEmulation, world_size: int) -> None:
        self.link = link
        self.world_size = world_size
        self.busy_until = 0.0

    def deadline(self, nbytes: int, passes: int = 1) -> float:
        wire = passes * nbytes * (self.world_size - 1) / max(self.world_size, 1)
        start = max(time.monotonic(), self.busy_until)
        self.busy_until = start + self.link.latency + wire / self.link.bandwidth
        return self.busy_until
