"""The autograd bridge: the forward program as a `torch.autograd.Function`.

[Note: how the programs meet autograd]
The forward program runs inside a `torch.autograd.Function`, so the user's loss, computed
eagerly outside the graph, backpropagates into our backward program: `loss.backward()` hands
the Function the gradients of the model's outputs, and the Function runs the backward program
with those as its grad_output inputs. The values the backward needs (saved activations) are
held by the Function's context and released when the backward has run, or when autograd drops
the context without one; `SavedActivations` counts their bytes meanwhile. An empty tensor that
requires grad (the engine's anchor) is an input, so the outputs have a grad_fn even though no
parameter is a tensor autograd knows.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Protocol

import torch

__all__ = ["ProgramPair", "RunProgram", "SavedActivations"]


class SavedActivations:
    """Bytes of the activations the forwards keep for their backwards, alive now and at most
    (`Engine.memory_report()`'s "activations"; gathered parameters kept for the backward are
    counted with the gathered buffers instead)."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def hold(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def release(self, nbytes: int) -> None:
        self.current -= nbytes


class ProgramPair(Protocol):
    """What the bridge needs of the engine: run the forward program, and later its backward."""

    rank: int
    _activations: SavedActivations

    def _run_forward(self, runners: Any, inputs: tuple, for_backward: bool) -> tuple[list, Optional[list], int]: ...

    def _run_backward(self, runners: Any, saved: list, grad_outputs: list) -> dict: ...


class RunProgram(torch.autograd.Function):
    """See [Note: how the programs meet autograd]."""

    @staticmethod
    def forward(ctx, engine: ProgramPair, runners: Any, for_backward: bool, anchor: torch.Tensor,
                *inputs: torch.Tensor):
        outputs, saved, nbytes = engine._run_forward(runners, inputs, for_backward)
        ctx.engine, ctx.runners, ctx.saved = engine, runners, saved
        engine._activations.hold(nbytes)
        ctx.release = weakref.finalize(ctx, engine._activations.release, nbytes)  # (at the backward, or when dropped)
        sig = runners.compiled.signature
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in outputs]
        ctx.mark_non_differentiable(*[o for o, d in zip(outputs, sig.differentiable) if not d])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]) -> Any:
        if ctx.saved is None:
            raise RuntimeError(
                f"[rank {ctx.engine.rank}] backward ran twice through one fxzero forward; "
                "call forward again for each backward"
            )
        sig = ctx.runners.compiled.signature
        grad_outputs = [
            g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, (shape, dtype, device), d in zip(grads, ctx.shapes, sig.differentiable)
            if d
        ]
        saved, ctx.saved = ctx.saved, None
        ctx.release()
        input_grads = ctx.engine._run_backward(ctx.runners, saved, grad_outputs)
        # (the gradients of the inputs that required grad: [Note: inputs that require grad])
        return (None, None, None, None) + tuple(input_grads.get(i) for i in range(len(ctx.needs_input_grad) - 4))
