"""User-facing configuration: `Config` and the policies it holds (frozen, keyword-only dataclasses).

- `policies`: `UnitsPolicy`, `AdamW`, `Prefetch`, `Bucket`, `LinkEmulation`;
- `placement`: where model states live, `Device`, `Cpu`, `Nvme`, and `Offload`;
- `precision`: `MixedPrecision` and float16's `LossScale`;
- `config`: `Config` itself; `deepspeed`: `from_deepspeed`, a DeepSpeed config read key by key.
"""

from fxzero.config.config import TRANSPORTS, Config
from fxzero.config.placement import STATE_KINDS, Cpu, Device, Nvme, Offload, Placement
from fxzero.config.policies import Adam, AdamW, Bucket, LinkEmulation, Prefetch, UnitsPolicy
from fxzero.config.precision import LossScale, MixedPrecision

__all__ = [
    "STATE_KINDS",
    "TRANSPORTS",
    "Adam",
    "AdamW",
    "Bucket",
    "Config",
    "Cpu",
    "Device",
    "LinkEmulation",
    "LossScale",
    "MixedPrecision",
    "Nvme",
    "Offload",
    "Placement",
    "Prefetch",
    "UnitsPolicy",
]
