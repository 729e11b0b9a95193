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
