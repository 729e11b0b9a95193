"""The schedule: what the runtime executes, as data.

- `types`: `Schedule`, `ProgramSchedule`, `ScheduleError` (frozen, versioned, JSON);
- `build`: `build_schedule`, the programs ordered and lowered into instructions;
- `validate`: `validate`, `fingerprint_of`, `check_fingerprints`.
"""

from fxzero.schedule.build import build_schedule
from fxzero.schedule.types import SCHEDULE_VERSION, ProgramSchedule, Schedule, ScheduleError
from fxzero.schedule.validate import check_fingerprints, fingerprint_of, validate

__all__ = [
    "SCHEDULE_VERSION",
    "ProgramSchedule",
    "Schedule",
    "ScheduleError",
    "build_schedule",
    "check_fingerprints",
    "fingerprint_of",
    "validate",
]
