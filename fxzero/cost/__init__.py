"""Cost model and simulator: what a schedule would cost on some hardware, without running it.

- `model`: `CostModel` and `Link`, pricing compute, collectives and storage I/O;
- `presets`: hardware we do not have (`PRESETS`);
- `simulate`: a Schedule replayed on compute, comm and io streams;
- `calibrate`: this machine measured, and `Config.cost_model` resolved.
"""

from fxzero.cost.calibrate import calibrate, resolve
from fxzero.cost.model import DEFAULT_IO, ComputeRates, CostModel, Link, Topology
from fxzero.cost.presets import PRESETS, preset
from fxzero.cost.simulate import Event, SimResult, simulate

__all__ = ["DEFAULT_IO", "PRESETS", "ComputeRates", "CostModel", "Event", "Link", "SimResult", "Topology", "calibrate",
           "preset", "resolve", "simulate"]
