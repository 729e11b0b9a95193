"""Where this rank's tensors live between uses: storage tiers, buffers, and the offload store.

- `tier`: the interface every tier shares (`StorageTier`, `Pending`);
- `memory`: `DeviceTier`, `CpuTier`; `nvme`: `NvmeTier`, with its file format (`nvme_format`)
  and I/O workers (`io_pool`);
- `aligned`: 4096-aligned host buffers (O_DIRECT in place);
- `write_behind`: writes copied to memory and finished behind the program's back;
- `pool`: the executor's per-unit buffers, reused across units and steps;
- `offload_store`: `OffloadStore`, the config's placements as tiers and keys;
- `disk_probe`: the disk under an `Nvme` placement measured for `cost_model="measure"`.
"""

from fxzero.runtime.storage.aligned import ALIGN, aligned_empty
from fxzero.runtime.storage.memory import CpuTier, DeviceTier
from fxzero.runtime.storage.nvme import DiskFull, NvmeTier
from fxzero.runtime.storage.tier import Pending, StorageTier

__all__ = ["ALIGN", "CpuTier", "DeviceTier", "DiskFull", "NvmeTier", "Pending", "StorageTier", "aligned_empty"]
