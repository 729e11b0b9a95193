"""`torchvision.datasets.CIFAR10`, synthetic: CIFAR-10's shapes and label range, no download.

The sizes: `FXZERO_CIFAR_TRAIN` (default 320) and `FXZERO_CIFAR_TEST` (default 64) samples, so a
run is a chosen number of steps (320 / train_batch_size 16 = 20 steps per epoch).
"""

import os

import torch
from torch.utils.data import Dataset


class CIFAR10(Dataset):
    def __init__(self, root, train=True, transform=None, target_transform=None, download=False):
        n = int(os.environ.get("FXZERO_CIFAR_TRAIN" if train else "FXZERO_CIFAR_TEST", 320 if train else 64))
        g = torch.Generator().manual_seed(1234 if train else 4321)
        self.data = torch.rand(n, 3, 32, 32, generator=g) * 2 - 1
        # A learnable task: the label follows the mean of one channel's quadrant.
        self.targets = ((self.data[:, 0, :16, :16].mean(dim=(1, 2)) + 0.05) * 100).long().clamp(0, 9)
        self.transform, self.target_transform = transform, target_transform

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i], int(self.targets[i])
        if self.transform is not None:
            x = self.transform(x)
        if self.target_transform is not None:
            y = self.target_transform(y)
        return x, y
