"""The schedule: what the runtime executes, as data.

- `types`: `Schedule`, `ProgramSchedule`, `ScheduleError` (frozen, versioned, JSON);
- `build`: `build_schedule`, the programs ordered and lowered into instructions;
- `validate`: `validate`, `fingerprint_of`, `collective_sequence`, `first_difference`.
"""

from fxzero.schedule.build import build_schedule
from fxzero.schedule.types import SCHEDULE_VERSION, ProgramSchedule, Schedule, ScheduleError
from fxzero.schedule.validate import collective_sequence, fingerprint_of, first_difference, validate

__all__ = [
    "SCHEDULE_VERSION",
    "ProgramSchedule",
    "Schedule",
    "ScheduleError",
    "build_schedule",
    "collective_sequence",
    "first_difference",
    "fingerprint_of",
    "validate",
]
