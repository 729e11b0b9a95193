"""torchvision.transforms as the cifar script uses them: the synthetic dataset already yields
normalized tensors, so the composed transform is applied as given (each step the identity on a
tensor it was made for)."""


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class ToTensor:
    def __call__(self, x):
        return x  # (the synthetic images are tensors already)


class Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = mean, std

    def __call__(self, x):
        return x  # (the synthetic images are in [-1, 1], what Normalize(0.5, 0.5) makes of [0, 1])
