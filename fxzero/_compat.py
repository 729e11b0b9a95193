"""Every private PyTorch API fxzero touches, in one place.

A torch upgrade that moves one of these should only need a change here.
"""

import torch.utils._pytree as pytree  # noqa: F401  (tree_flatten, tree_map, TreeSpec)
from torch._decomp import get_decompositions  # noqa: F401
from torch._ops import OpOverload  # noqa: F401
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode  # noqa: F401
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode  # noqa: F401
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: F401
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401

__all__ = ["DataDependentOutputException", "FakeTensor", "FakeTensorMode", "GuardOnDataDependentSymNode",
           "OpOverload", "TorchDispatchMode", "get_decompositions", "make_fx", "pytree"]

# torch.optim's functional updates (each module's `foreach=False` path is its single-tensor
# implementation) and the dtype torch keeps an optimizer's per-parameter numbers in: the
# arithmetic fxzero runs on shards for the optimizers it does not write itself
# (fxzero/runtime/torch_updates.py).
from torch.optim.adadelta import adadelta as adadelta_update  # noqa: F401
from torch.optim.adam import adam as adam_update  # noqa: F401
from torch.optim.adamax import adamax as adamax_update  # noqa: F401
from torch.optim.asgd import asgd as asgd_update  # noqa: F401
from torch.optim.nadam import nadam as nadam_update  # noqa: F401
from torch.optim.optimizer import _get_scalar_dtype as optimizer_scalar_dtype  # noqa: F401
from torch.optim.radam import radam as radam_update  # noqa: F401
from torch.optim.rmsprop import rmsprop as rmsprop_update  # noqa: F401
from torch.optim.rprop import rprop as rprop_update  # noqa: F401
from torch.optim.sgd import sgd as sgd_update  # noqa: F401

LR_SCHEDULER_TRACKS_STEP = "_wrapped_by_lr_sched"
"""The attribute torch's LR schedulers put on an optimizer's wrapped `step` (lr_scheduler.py)."""
LR_SCHEDULER_SAW_STEP = "_opt_called"
"""The attribute that wrapped `step` sets on the optimizer, read by the scheduler's order check."""

__all__ += ["LR_SCHEDULER_SAW_STEP", "LR_SCHEDULER_TRACKS_STEP", "adadelta_update", "adam_update", "adamax_update",
            "asgd_update", "nadam_update", "optimizer_scalar_dtype", "radam_update", "rmsprop_update", "rprop_update",
            "sgd_update"]
