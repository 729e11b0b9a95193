"""Every private PyTorch API fxzero touches, in one place.

A torch upgrade that moves one of these should only need a change here.
"""

from torch._decomp import get_decompositions  # noqa: F401
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: F401
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: F401

__all__ = ["FakeTensor", "FakeTensorMode", "get_decompositions", "make_fx"]
