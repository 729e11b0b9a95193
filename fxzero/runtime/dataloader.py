"""The training dataloader `fxzero.initialize` returns: each rank its own part of the dataset.

A torch `DataLoader` over a `DistributedSampler` (DeepSpeed's choice too): the ranks see
disjoint parts of one permutation, each of the same length (the sampler pads with repeated
samples unless `drop_last`), in micro-batches of `train_micro_batch_size_per_gpu`. Every new
pass over the loader is a new epoch, reshuffled: the loader calls the sampler's `set_epoch`
itself, so a loop that forgets to (the textbook DeepSpeed script does) still reshuffles.

It counts the batches it has handed out in the current pass, so a checkpoint saves its position
(`state_dict`) and a resumed run continues with the next batch of the same epoch
(`load_state_dict`): the batches before it are skipped by index, never loaded.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

__all__ = ["ShardedDataLoader"]


class _From(Sampler):
    """`sampler`'s indices from the `start`-th on."""

    def __init__(self, sampler: Sampler, start: int) -> None:
        self.sampler, self.start = sampler, start

    def __iter__(self) -> Iterator[int]:
        for i, index in enumerate(self.sampler):
            if i >= self.start:
                yield index

    def __len__(self) -> int:
        return max(len(self.sampler) - self.start, 0)


class ShardedDataLoader:
    def __init__(self, dataset: Dataset, *, batch_size: int, rank: int, world_size: int,
                 collate_fn: Optional[Callable] = None, drop_last: bool = False, seed: int = 0,
                 num_workers: int = 0) -> None:
        self.data_sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                               seed=seed, drop_last=drop_last)
        """DeepSpeed's name for the sampler."""
        self._options = dict(batch_size=batch_size, collate_fn=collate_fn, drop_last=drop_last,
                             num_workers=num_workers)
        self.dataset = dataset
        self.loader = DataLoader(dataset, sampler=self.data_sampler, **self._options)
        self.batch_size = batch_size
        self.world_size = world_size
        self.epoch = 0
        """The epoch the next pass over the loader is (its shuffle's seed is seed + epoch)."""
        self.position = 0
        """Batches handed out in the current pass (the epoch before `epoch`)."""
        self._resume: Optional[int] = None  # batches of `epoch` to skip in the next pass

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch `epoch` (to resume at one, or repeat one)."""
        self.epoch = epoch
        self._resume = None

    def __iter__(self) -> Iterator[Any]:
        self.data_sampler.set_epoch(self.epoch)
        self.epoch += 1
        skip, self._resume = self._resume or 0, None
        loader = self.loader
        if skip:
            loader = DataLoader(self.dataset, sampler=_From(self.data_sampler, skip * self.batch_size), **self._options)
        self.position = skip
        for batch in loader:
            self.position += 1
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, int]:
        """Where the loader is: the epoch of the current pass and the batches it has handed out."""
        return {"epoch": self.epoch - 1, "position": self.position, "batch_size": self.batch_size,
                "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Make the next pass continue `state`'s: the same epoch, from the batch after the last one
        handed out (from the same sample on, counted over all ranks, when the batch size or the
        world size changed; a finished epoch resumes at the next one)."""
        epoch, position = state["epoch"], state["position"]
        if epoch < 0:  # saved before the first pass
            self.set_epoch(0)
            return
        samples = position * state["batch_size"] * state["world_size"]
        skip = samples // (self.batch_size * self.world_size)
        if skip >= len(self.loader):
            self.set_epoch(epoch + 1)
            return
        self.epoch, self._resume = epoch, skip
