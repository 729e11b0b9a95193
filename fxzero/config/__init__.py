"""User-facing configuration: `Config` and the policies it holds (frozen, keyword-only dataclasses).

- `policies`: `UnitsPolicy`, `LeafModules`, `Prefetch`, `Bucket`, `LinkEmulation`, and the optimizers of
  `optimizers` (`OptimizerPolicy`: `AdamW`, `Adam`, `Adamax`, `NAdam`, `RAdam`, `Adagrad`, `SGD`,
  `RMSprop`, `Adadelta`, `ASGD`, `Rprop`, `Lion`, `Lamb`);
- `placement`: where model states live, `Device`, `Cpu`, `Nvme`, and `Offload`;
- `precision`: `MixedPrecision`, float16's `LossScale`, and `Autocast`;
- `random_ltd`: `RandomLTD`, DeepSpeed's random layer-token drop;
- `activations`: `Activations`, what the forward keeps for the backward and what is recomputed;
- `tiling`: `Tiling`, operators too wide to gather whole computed as tiles;
- `config`: `Config` itself; `deepspeed`: `from_deepspeed`, a DeepSpeed config read key by key.
"""

from fxzero.config.activations import Activations
from fxzero.config.config import TRANSPORTS, Config
from fxzero.config.placement import OPTIMIZER_STATES, Cpu, Device, Nvme, Offload, Placement, state_kinds
from fxzero.config.policies import (ASGD, OPTIMIZERS, SGD, Adadelta, Adagrad, Adam, Adamax, AdamW, Bucket,
                                    Lamb, LeafModules, LinkEmulation, Lion, NAdam, OptimizerPolicy, Prefetch, RAdam, RMSprop, Rprop,
                                    UnitsPolicy)
from fxzero.config.precision import Autocast, LossScale, MixedPrecision
from fxzero.config.random_ltd import RandomLTD
from fxzero.config.tiling import Tiling

__all__ = [
    "OPTIMIZERS",
    "OPTIMIZER_STATES",
    "TRANSPORTS",
    "ASGD",
    "Activations",
    "Adadelta",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "Autocast",
    "Bucket",
    "Config",
    "Cpu",
    "Device",
    "Lamb",
    "LeafModules",
    "LinkEmulation",
    "Lion",
    "LossScale",
    "MixedPrecision",
    "NAdam",
    "Nvme",
    "Offload",
    "OptimizerPolicy",
    "Placement",
    "Prefetch",
    "RAdam",
    "RandomLTD",
    "RMSprop",
    "Rprop",
    "SGD",
    "Tiling",
    "UnitsPolicy",
    "state_kinds",
]
