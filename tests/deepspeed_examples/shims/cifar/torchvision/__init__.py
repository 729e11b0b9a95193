"""A data source in torchvision's shape, for running DeepSpeedExamples' cifar script offline.

Only what `training/cifar/cifar10_deepspeed.py` imports: `datasets.CIFAR10` and `transforms`.
No download: `CIFAR10` yields synthetic images of CIFAR-10's shape (3 x 32 x 32 floats in
[-1, 1], what ToTensor + Normalize(0.5, 0.5) gives) and labels 0..9, the same on every run and
rank. The real torchvision (a CUDA build on this machine) is never imported.
"""

from . import datasets, transforms  # noqa: F401
