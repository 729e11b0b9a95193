"""The training dataloader `fxzero.initialize` returns: each rank its own part of the dataset.

A torch `DataLoader` over a `DistributedSampler` (DeepSpeed's choice too): the ranks see
disjoint parts of one permutation, each of the same length (the sampler pads with repeated
samples unless `drop_last`), in micro-batches of `train_micro_batch_size_per_gpu`. Every new
pass over the loader is a new epoch, reshuffled: the loader calls the sampler's `set_epoch`
itself, so a loop that forgets to (the textbook DeepSpeed script does) still reshuffles.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = ["ShardedDataLoader"]


class ShardedDataLoader:
    def __init__(self, dataset: Dataset, *, batch_size: int, rank: int, world_size: int,
                 collate_fn: Optional[Callable] = None, drop_last: bool = False, seed: int = 0,
                 num_workers: int = 0) -> None:
        self.data_sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                               seed=seed, drop_last=drop_last)
        """DeepSpeed's name for the sampler."""
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.data_sampler, collate_fn=collate_fn,
                                 drop_last=drop_last, num_workers=num_workers)
        self.batch_size = batch_size
        self.epoch = 0
        """The epoch the next pass over the loader is (its shuffle's seed is seed + epoch)."""

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch `epoch` (to resume at one, or repeat one)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        self.data_sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)
