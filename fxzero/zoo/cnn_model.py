"""CNN: a small BatchNorm image classifier (its running statistics test per-rank buffers)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from fxzero.zoo.common import EXAMPLE_SEED, check_positive

__all__ = ["CNN", "CNNConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CNNConfig:
    """Shape of the small image classifier; its BatchNorm buffers test per-rank buffers."""

    in_channels: int = 3
    """Channels of the input images."""
    channels: tuple[int, ...] = (8, 16)
    """Output channels of each ConvBlock, in order."""
    num_classes: int = 10
    """Number of output logits."""
    image_size: int = 8
    """Height and width of the example inputs (any size works: the pool is adaptive)."""

    def __post_init__(self) -> None:
        if not self.channels:
            raise ValueError("CNNConfig.channels must name at least one ConvBlock, e.g. (8, 16)")
        check_positive(
            "CNNConfig",
            in_channels=self.in_channels,
            num_classes=self.num_classes,
            image_size=self.image_size,
        )
        for c in self.channels:
            check_positive("CNNConfig", channels=c)


class ConvBlock(nn.Module):
    """Conv2d(3x3, padding 1) -> BatchNorm2d -> ReLU; keeps the spatial size."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        # No bias: BatchNorm subtracts each channel's batch mean, so a conv bias has an
        # identically zero gradient that Adam would turn into +-lr noise (see
        # CausalSelfAttention.qkv), as well as being redundant with the BatchNorm's own shift.
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class CNN(nn.Module):
    """ConvBlocks, global average pool, linear head.

    Args:
        cfg: The model's shape; the default is ConvBlock(3, 8) -> ConvBlock(8, 16) -> Linear(16, 10).
    """

    def __init__(self, cfg: CNNConfig = CNNConfig()) -> None:
        super().__init__()
        if not isinstance(cfg, CNNConfig):
            raise TypeError(f"CNN takes a CNNConfig, got {type(cfg).__name__}")
        self.config = cfg
        widths = (cfg.in_channels, *cfg.channels)
        self.features = nn.Sequential(*[ConvBlock(a, b) for a, b in zip(widths, widths[1:])])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.head = nn.Linear(cfg.channels[-1], cfg.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits of shape (B, num_classes) for images of shape (B, C, H, W)."""
        return self.head(self.flatten(self.pool(self.features(x))))

    def example_inputs(self, batch: int = 2) -> tuple[torch.Tensor]:
        """One deterministic batch of images, shape (batch, C, H, W), on the CPU.

        Drawn from a private generator, so calling this never changes the global RNG.
        """
        gen = torch.Generator().manual_seed(EXAMPLE_SEED)
        c, s = self.config.in_channels, self.config.image_size
        return (torch.randn(batch, c, s, s, generator=gen, device="cpu"),)
