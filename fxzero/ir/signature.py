"""`JointSignature`: what the flat inputs and outputs of a traced joint graph mean; how a call's
arguments are flattened into them (`flatten_call`), shared by the tracer and the engine.

[Note: inputs that require grad]
A floating point input that requires grad when the engine is called (an adversarial perturbation,
`inputs_embeds` computed by modules called outside the engine, a leaf whose `.grad` the caller
reads) gets its gradient, as it does when the model is called eagerly: the trace differentiates
the joint graph with respect to such inputs too, their gradients are the joint graph's last
outputs (after the new buffer values), the backward program returns them ("input_grad" outputs,
each rank's own: never reduced), and the autograd bridge hands them back to autograd
(`RunProgram.backward`), which accumulates them into a leaf's `.grad` or carries them on to
whatever computed the input. Which inputs require grad is part of what a program is compiled for
(`Engine._key`). An input cast to the compute dtype in the program (mixed precision) gets its
gradient in its own dtype, through the cast.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

from fxzero._compat import pytree

__all__ = ["JointSignature", "argument_name", "flatten_call"]


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
    constant_outputs: tuple[tuple[int, Any], ...] = ()
    """(position among `out_spec`'s leaves, value) of the output leaves that are not tensors:
    constants the forward returned, or None where it returned an object a step cannot use (a
    KV cache). The tensor outputs fill the other positions, in order."""
    input_grads: tuple[int, ...] = ()
    """The tensor inputs (positions among them) that required grad when traced: the joint
    graph's last outputs are their gradients, in this order ([Note: inputs that require grad])."""

    def new_buffer_results(self, results: Sequence[Any], n_grads: int) -> list:
        """The new buffer values among a joint graph's outputs (`results`): after the model's
        outputs and the `n_grads` gradient outputs (per parameter, or per unit once reduced),
        before the inputs' gradients."""
        return list(results[self.num_outputs + n_grads : len(results) - len(self.input_grads)])

    def input_grad_results(self, results: Sequence[Any]) -> list:
        """The inputs' gradients among a joint graph's outputs, in `input_grads`' order."""
        return list(results[len(results) - len(self.input_grads):]) if self.input_grads else []

    def rebuild_outputs(self, tensors: Sequence[Any]) -> Any:
        """The model's outputs, as it returned them, from the flat tensor outputs."""
        leaves = list(tensors)
        for position, value in self.constant_outputs:
            leaves.insert(position, value)
        return pytree.tree_unflatten(leaves, self.out_spec)


def flatten_call(args: Sequence[Any], kwargs: Optional[Mapping[str, Any]] = None) -> tuple[list, Any]:
    """The leaves of a call's arguments (positional and keyword, nested tuples, lists and dicts)
    and their structure (`pytree`); a None argument is a leaf, a constant like a bool."""
    return pytree.tree_flatten((tuple(args), dict(kwargs or {})))


def argument_name(path: tuple) -> str:
    """The argument a leaf of `flatten_call` is, from its pytree path: "0" (the first positional
    one), "attention_mask", "batch['ids'][1]"."""
    positional, rest = path[0].idx == 0, path[1:]
    head = str(rest[0].idx) if positional else rest[0].key
    return head + pytree.keystr(rest[1:])
