"""The ordered pass pipeline. See README.md beside this file for the IR's invariants."""

from fxzero.passes import insert_gather_free, insert_reduce_scatter, partition, separate_phases, split
from fxzero.passes.runner import Pass


def build_pipeline(*, stage: int) -> list[Pass]:
    """The passes for a ZeRO stage: stages differ only in the knobs bound here."""
    return [
        partition.make(sharded=stage == 3),
        separate_phases.PASS,
        insert_gather_free.PASS,
        insert_reduce_scatter.make(keep_full=stage == 1),
        split.PASS,
    ]
