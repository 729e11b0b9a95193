"""User-facing configuration: `Config` and the policies it holds (frozen, keyword-only dataclasses).

- `policies`: `UnitsPolicy`, the optimizers (`AdamW`, `Adam`, `Adagrad`: `OptimizerPolicy`), `Prefetch`,
  `Bucket`, `LinkEmulation`;
- `placement`: where model states live, `Device`, `Cpu`, `Nvme`, and `Offload`;
- `precision`: `MixedPrecision` and float16's `LossScale`;
- `config`: `Config` itself; `deepspeed`: `from_deepspeed`, a DeepSpeed config read key by key.
"""

from fxzero.config.config import TRANSPORTS, Config
from fxzero.config.placement import OPTIMIZER_STATES, Cpu, Device, Nvme, Offload, Placement, state_kinds
from fxzero.config.policies import (OPTIMIZERS, Adagrad, Adam, AdamW, Bucket, LinkEmulation, OptimizerPolicy, Prefetch,
                                    UnitsPolicy)
from fxzero.config.precision import LossScale, MixedPrecision

__all__ = [
    "OPTIMIZERS",
    "OPTIMIZER_STATES",
    "TRANSPORTS",
    "Adagrad",
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
    "OptimizerPolicy",
    "Placement",
    "Prefetch",
    "UnitsPolicy",
    "state_kinds",
]
