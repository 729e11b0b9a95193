"""The dataloader fxzero.initialize returns: each rank its own part, reshuffled every epoch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

from fxzero.runtime.dataloader import ShardedDataLoader

pytestmark = pytest.mark.timeout(60)


class Indices(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def _epoch(loader) -> list[int]:
    return [int(i) for batch in loader for i in batch]


def _loaders(n: int, world: int, **kw) -> list[ShardedDataLoader]:
    return [ShardedDataLoader(Indices(n), batch_size=3, rank=r, world_size=world, **kw) for r in range(world)]


def test_each_rank_gets_its_own_part_of_one_permutation():
    loaders = _loaders(12, 2)
    parts = [_epoch(lo) for lo in loaders]
    assert len(parts[0]) == len(parts[1]) == 6 and not set(parts[0]) & set(parts[1])
    assert sorted(parts[0] + parts[1]) == list(range(12))
    assert [len(b) for b in loaders[0].loader] == [3, 3]  # micro-batches of the configured size


def test_every_pass_is_a_new_epoch_reshuffled_and_set_epoch_repeats_one():
    (lo,) = _loaders(40, 1)
    first, second = _epoch(lo), _epoch(lo)
    assert sorted(first) == sorted(second) == list(range(40)) and first != second
    lo.set_epoch(0)
    assert _epoch(lo) == first


def test_uneven_dataset_gives_every_rank_the_same_number_of_batches():
    """(so no rank waits in a collective for a batch another rank does not have)"""
    padded = _loaders(13, 2)
    assert [len(_epoch(lo)) for lo in padded] == [7, 7]  # one sample repeated, as DistributedSampler pads
    dropped = _loaders(13, 2, drop_last=True)
    assert [len(_epoch(lo)) for lo in dropped] == [6, 6]  # floor(13 / 2) each, in batches of 3
    assert [len(lo) for lo in dropped] == [2, 2]
