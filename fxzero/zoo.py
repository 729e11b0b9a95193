"""A small built-in model zoo for tests, the demo and the CLI.

Every model here is made only of standard torch layers initialized by their own
`reset_parameters()`, in the order the modules are registered. That is what lets fxzero build a
model on the meta device and materialize it later: under the same `torch.manual_seed`, calling
`reset_parameters()` module by module in `model.modules()` order reproduces eager construction
exactly. Two rules keep that true, so keep them when adding a model:

- no custom `self.apply(init_fn)` pass, and no parameter created outside a layer;
- every submodule is constructed right where it is registered, so construction order (the
  order the RNG is consumed eagerly) equals registration order (the order `modules()` yields).

A tied parameter (`GPT.lm_head.weight is GPT.wte.weight`) is initialized by the first module
that owns it; eagerly, the later owner's own initialization is thrown away when the tie is made.

Models build from a frozen config; `build(name, **overrides)` is the registry the CLI uses.
Rotary tables are computed in the forward (a pure function of the shape), not held in buffers.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "CNN",
    "CNNConfig",
    "GPT",
    "GPTConfig",
    "GPT_SIZES",
    "LLAMA_SIZES",
    "Llama",
    "LlamaConfig",
    "MODELS",
    "build",
    "gpt",
    "llama",
]

# Example inputs come from their own generator so that asking for them never moves the global
# RNG, which would change the initialization of a model built afterwards.
_EXAMPLE_SEED = 1234


def _check_positive(owner: str, **fields: int) -> None:
    for name, value in fields.items():
        if not (isinstance(value, int) and value > 0):
            raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


# ---------------------------------------------------------------------------------------------
# GPT


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a decoder-only transformer (GPT-2 style, pre-norm, no dropout)."""

    vocab_size: int
    """Number of token ids; inputs must lie in [0, vocab_size)."""
    d_model: int
    """Width of the residual stream."""
    n_heads: int
    """Attention heads; must divide d_model."""
    n_blocks: int
    """Number of transformer blocks (each block is one default fxzero unit)."""
    seq_len: int
    """Longest sequence the learned position embedding covers."""
    tie_head: bool = True
    """Share the output projection's weight with the token embedding."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of d_model."""

    def __post_init__(self) -> None:
        _check_positive(
            "GPTConfig",
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_blocks=self.n_blocks,
            seq_len=self.seq_len,
            mlp_ratio=self.mlp_ratio,
        )
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_heads "
                f"({self.n_heads}); pick n_heads among the divisors of d_model"
            )


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused qkv projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        # No bias: the key third of a qkv bias has an identically zero gradient (adding a
        # constant to every key shifts all of a query's scores equally, and softmax ignores
        # that), so Adam would turn its rounding noise into +-lr updates and no two correct
        # implementations would agree on it. Parity tests compare parameters to 1e-5.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Reshape with unflatten/permute rather than unpacking x.shape, so the module also
        # traces with torch.fx.symbolic_trace, where shapes are proxies.
        qkv = self.qkv(x).unflatten(-1, (3, self.n_heads, self.head_dim))
        qkv = qkv.permute(2, 0, 3, 1, 4)  # (3, B, heads, T, head_dim)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        return self.proj(y.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear -> GELU -> Linear."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model.

    Args:
        cfg: The model's shape.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"GPT takes a GPTConfig, got {type(cfg).__name__}; see fxzero.zoo.gpt()")
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_blocks)])
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_head:
            # The embedding's initialization wins: lm_head's own init above is discarded. It
            # still consumed RNG, but last, so no other parameter's values depend on it.
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-token logits.

        Args:
            idx: Token ids, LongTensor of shape (B, T) with T <= seq_len.

        Returns:
            Logits of shape (B, T, vocab_size).
        """
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def example_inputs(self, batch: int = 2) -> tuple[torch.Tensor]:
        """One deterministic batch of token ids, shape (batch, seq_len), on the CPU.

        Always on the CPU (even under `with torch.device("meta")`) and drawn from a private
        generator, so calling this never changes the global RNG.
        """
        gen = torch.Generator().manual_seed(_EXAMPLE_SEED)
        shape = (batch, self.config.seq_len)
        return (torch.randint(0, self.config.vocab_size, shape, generator=gen, device="cpu"),)


GPT_SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=96, d_model=32, n_heads=2, n_blocks=4, seq_len=16),
    # ~25M parameters; an untied head exercises a root unit with two large matrices.
    "small": GPTConfig(
        vocab_size=8192, d_model=512, n_heads=8, n_blocks=6, seq_len=128, tie_head=False
    ),
    # GPT-2 small (~124M) with a shorter context.
    "gpt2": GPTConfig(vocab_size=50257, d_model=768, n_heads=12, n_blocks=12, seq_len=256),
    "1b": GPTConfig(vocab_size=32000, d_model=2048, n_heads=16, n_blocks=24, seq_len=128),
    # ~2.2B: 16 bytes per parameter of model states (35 GB) exceed a 24 GiB machine's memory.
    # Untied head: a tied one scores with the N(0, 1) embedding, so the initial loss is ~1400.
    "2b": GPTConfig(vocab_size=32000, d_model=2560, n_heads=20, n_blocks=26, seq_len=128, tie_head=False),
}
"""Named GPT shapes for `gpt(size)`."""


def gpt(size: str, **overrides) -> GPT:
    """Build a GPT of a named size.

    Args:
        size: One of `GPT_SIZES` ("tiny", "small", "gpt2", "1b", "2b").
        **overrides: GPTConfig fields to change, e.g. `n_blocks=2`.

    Raises:
        ValueError: for an unknown size.
        TypeError: for an override that is not a GPTConfig field.
    """
    if size not in GPT_SIZES:
        raise ValueError(f"unknown GPT size {size!r}; choose one of {sorted(GPT_SIZES)}")
    return GPT(_replace(GPT_SIZES[size], overrides))


# ---------------------------------------------------------------------------------------------
# Llama


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of a Llama-style decoder: RMSNorm, rotary positions, SwiGLU MLP, no biases."""

    vocab_size: int
    """Number of token ids; inputs must lie in [0, vocab_size)."""
    d_model: int
    """Width of the residual stream."""
    n_heads: int
    """Query heads; must divide d_model."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None means n_heads. Must divide n_heads."""
    n_blocks: int
    """Number of decoder blocks (each block is one default fxzero unit)."""
    hidden: int
    """Hidden width of the SwiGLU MLP (11008 for the 7B model)."""
    seq_len: int
    """Length of the example inputs; rotary positions have no learned table, so no limit."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of the RMSNorms."""

    def __post_init__(self) -> None:
        _check_positive(
            "LlamaConfig",
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_blocks=self.n_blocks,
            hidden=self.hidden,
            seq_len=self.seq_len,
        )
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"LlamaConfig.d_model ({self.d_model}) must be n_heads ({self.n_heads}) times an "
                "even head size (rotary embeddings rotate pairs of channels)"
            )
        if self.n_kv_heads is not None:
            _check_positive("LlamaConfig", n_kv_heads=self.n_kv_heads)
            if self.n_heads % self.n_kv_heads:
                raise ValueError(
                    f"LlamaConfig.n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})"
                )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def rotary_tables(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each of shape (seq_len, head_dim // 2).

    Computed in the forward rather than held in buffers: they are a pure function of the shape,
    so a model built on the meta device needs nothing materialized for them.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + head_dim/2) of x, shape (B, heads, T, head_dim), by position."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class LlamaAttention(nn.Module):
    """Causal self-attention with rotary positions and grouped-query key/value heads."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, self.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, self.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.wq(x).unflatten(-1, (self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.wk(x).unflatten(-1, (self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.wv(x).unflatten(-1, (self.n_kv_heads, self.head_dim)).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            repeat = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).flatten(2))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = LlamaAttention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Llama-style decoder-only language model (untied output head).

    Args:
        cfg: The model's shape.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if not isinstance(cfg, LlamaConfig):
            raise TypeError(f"Llama takes a LlamaConfig, got {type(cfg).__name__}; see fxzero.zoo.llama()")
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList([LlamaBlock(cfg) for _ in range(cfg.n_blocks)])
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-token logits of shape (B, T, vocab_size) for token ids idx of shape (B, T)."""
        cfg = self.config
        cos, sin = rotary_tables(idx.size(1), cfg.head_dim, cfg.rope_theta, idx.device)
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))

    def example_inputs(self, batch: int = 2) -> tuple[torch.Tensor]:
        """One deterministic batch of token ids, shape (batch, seq_len), on the CPU.

        Drawn from a private generator, so calling this never changes the global RNG.
        """
        gen = torch.Generator().manual_seed(_EXAMPLE_SEED)
        shape = (batch, self.config.seq_len)
        return (torch.randint(0, self.config.vocab_size, shape, generator=gen, device="cpu"),)


LLAMA_SIZES: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab_size=96, d_model=32, n_heads=4, n_kv_heads=2, n_blocks=2, hidden=64, seq_len=16),
    # ~30M parameters.
    "small": LlamaConfig(vocab_size=8192, d_model=512, n_heads=8, n_blocks=8, hidden=1408, seq_len=128),
    # Llama (1 and 2) 7B: 32 blocks of width 4096, 6.74B parameters.
    "7b": LlamaConfig(vocab_size=32000, d_model=4096, n_heads=32, n_blocks=32, hidden=11008, seq_len=2048),
}
"""Named Llama shapes for `llama(size)`."""


def llama(size: str, **overrides) -> Llama:
    """Build a Llama-style decoder of a named size.

    Args:
        size: One of `LLAMA_SIZES` ("tiny", "small", "7b").
        **overrides: LlamaConfig fields to change, e.g. `n_blocks=4`.

    Raises:
        ValueError: for an unknown size.
        TypeError: for an override that is not a LlamaConfig field.
    """
    if size not in LLAMA_SIZES:
        raise ValueError(f"unknown Llama size {size!r}; choose one of {sorted(LLAMA_SIZES)}")
    return Llama(_replace(LLAMA_SIZES[size], overrides))


# ---------------------------------------------------------------------------------------------
# CNN


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
        _check_positive(
            "CNNConfig",
            in_channels=self.in_channels,
            num_classes=self.num_classes,
            image_size=self.image_size,
        )
        for c in self.channels:
            _check_positive("CNNConfig", channels=c)


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
        gen = torch.Generator().manual_seed(_EXAMPLE_SEED)
        c, s = self.config.in_channels, self.config.image_size
        return (torch.randn(batch, c, s, s, generator=gen, device="cpu"),)


# ---------------------------------------------------------------------------------------------
# Registry


def _replace(cfg, overrides: dict):
    fields = {f.name for f in dataclasses.fields(cfg)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(
            f"unknown {type(cfg).__name__} field(s) {unknown}; valid fields: {sorted(fields)}"
        )
    return dataclasses.replace(cfg, **overrides)


MODELS: dict[str, Callable[..., nn.Module]] = {
    "gpt-tiny": lambda **kw: gpt("tiny", **kw),
    "gpt-small": lambda **kw: gpt("small", **kw),
    "gpt2": lambda **kw: gpt("gpt2", **kw),
    "gpt-1b": lambda **kw: gpt("1b", **kw),
    "gpt-2b": lambda **kw: gpt("2b", **kw),
    "llama-tiny": lambda **kw: llama("tiny", **kw),
    "llama-small": lambda **kw: llama("small", **kw),
    "llama-7b": lambda **kw: llama("7b", **kw),
    "cnn": lambda **kw: CNN(_replace(CNNConfig(), kw)),
}
"""Model builders by name; each takes config-field overrides as keyword arguments."""


def build(name: str, **overrides) -> nn.Module:
    """Build a zoo model by name.

    Builds on the current default device, so `with torch.device("meta"): build("gpt2")`
    allocates nothing.

    Args:
        name: One of `MODELS`: "gpt-tiny", "gpt-small", "gpt2", "gpt-1b", "gpt-2b", "llama-tiny",
            "llama-small", "llama-7b", "cnn".
        **overrides: Fields of the model's config to change, e.g. `build("gpt-tiny", n_blocks=2)`.

    Raises:
        ValueError: for an unknown name.
        TypeError: for an override that is not a field of the model's config.
    """
    if name not in MODELS:
        raise ValueError(f"unknown zoo model {name!r}; choose one of {sorted(MODELS)}")
    return MODELS[name](**overrides)
