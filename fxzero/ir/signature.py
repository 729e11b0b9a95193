"""`JointSignature`: what the flat inputs and outputs of a traced joint graph mean."""

from __future__ import annotations

import dataclasses

from fxzero._compat import pytree

__all__ = ["JointSignature"]


@dataclasses.dataclass(frozen=True)
class JointSignature:
    """What the flat inputs and outputs of a joint graph mean."""

    param_fqns: tuple[str, ...]
    """Unique parameters, in placeholder order."""
    trainable_fqns: tuple[str, ...]
    """Parameters that receive a gradient, in the order of the grad outputs."""
    buffer_fqns: tuple[str, ...]
    num_inputs: int
    out_spec: pytree.TreeSpec
    """Structure of the model's outputs, to rebuild them from the flat list."""
    num_outputs: int
    differentiable: tuple[bool, ...]
    """Per flat output: whether it has a grad_output placeholder (floating point outputs)."""
    mutated_buffers: tuple[str, ...]
    """Buffers the forward updates, in the order of the new_buffers outputs."""
    gradless_fqns: tuple[str, ...] = ()
    """Trainable parameters the outputs do not depend on (autograd gives them no gradient);
    like torch.optim, the optimizer leaves them untouched."""
