"""The batch triple: train_batch_size = micro-batch per rank x gradient_accumulation_steps x world.

DeepSpeed's rule, read once the world size is known: any two of the three imply the third; one
alone implies gradient_accumulation_steps = 1; all three must agree. Nothing given (a native
`fxzero.Config` whose loop picks its own batches): one micro-step per optimizer step and no
batch size the engine could report.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

__all__ = ["BatchSizes", "resolve_batch"]


class BatchSizes(NamedTuple):
    train_batch_size: Optional[int]
    micro_batch_size: Optional[int]
    gradient_accumulation_steps: int


def resolve_batch(train: Optional[int], micro: Optional[int], accumulation: Optional[int],
                  world_size: int) -> BatchSizes:
    """The three sizes, each implied by the others where not given.

    Raises:
        ValueError: the three disagree, or one does not divide (naming all three and the world).
    """
    def error(why: str) -> ValueError:
        return ValueError(
            f"batch sizes: {why} (train_batch_size={train}, train_micro_batch_size_per_gpu={micro}, "
            f"gradient_accumulation_steps={accumulation}, world size {world_size}); they must satisfy "
            "train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world size: "
            "give two of them, or three that agree")

    if train is not None and micro is not None and accumulation is not None:
        if train != micro * accumulation * world_size:
            raise error(f"{micro} * {accumulation} * {world_size} = {micro * accumulation * world_size}, "
                        f"not {train}")
        return BatchSizes(train, micro, accumulation)
    if train is not None and micro is not None:
        if train % (micro * world_size):
            raise error(f"{train} is not a multiple of {micro} * {world_size}")
        return BatchSizes(train, micro, train // (micro * world_size))
    if train is not None:
        accumulation = accumulation or 1
        if train % (accumulation * world_size):
            raise error(f"{train} is not a multiple of {accumulation} * {world_size}")
        return BatchSizes(train, train // (accumulation * world_size), accumulation)
    accumulation = accumulation or 1
    if micro is not None:
        return BatchSizes(micro * accumulation * world_size, micro, accumulation)
    return BatchSizes(None, None, accumulation)
