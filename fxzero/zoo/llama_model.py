"""Llama: a decoder with RMSNorm, rotary positions and a SwiGLU MLP."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxzero.zoo.common import EXAMPLE_SEED, check_positive, replace_fields

__all__ = ["LLAMA_SIZES", "Llama", "LlamaConfig", "llama"]


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
        check_positive(
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
            check_positive("LlamaConfig", n_kv_heads=self.n_kv_heads)
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
    """Rotate channel pairs (i, i + head_dim/2) of x, shape (B, heads, T, head_dim), by position.

    The tables are computed in fp32 and applied in x's dtype, as Hugging Face's Llama applies
    them: under bf16 compute q and k stay bf16, the dtype of v (SDPA needs all three alike)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
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
        gen = torch.Generator().manual_seed(EXAMPLE_SEED)
        shape = (batch, self.config.seq_len)
        return (torch.randint(0, self.config.vocab_size, shape, generator=gen, device="cpu"),)


LLAMA_SIZES: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab_size=96, d_model=32, n_heads=4, n_kv_heads=2, n_blocks=2, hidden=64, seq_len=16),
    # ~30M parameters.
    "small": LlamaConfig(vocab_size=8192, d_model=512, n_heads=8, n_blocks=8, hidden=1408, seq_len=128),
    # Llama (1 and 2) 7B: 32 blocks of width 4096, 6.74B parameters.
    "7b": LlamaConfig(vocab_size=32000, d_model=4096, n_heads=32, n_blocks=32, hidden=11008, seq_len=2048),
    # Llama 3 8B and 70B as Meta published them: params.json of meta-llama/Meta-Llama-3-8B and
    # -70B (dim, n_layers, n_heads, n_kv_heads, vocab_size, norm_eps 1e-5, rope_theta 500000;
    # the SwiGLU width, 14336 and 28672, from ffn_dim_multiplier 1.3 and multiple_of 1024 / 4096,
    # as their config.json's intermediate_size states), at their 8192-token context. 8.03B and
    # 70.6B parameters (untied embedding and head of 128256 tokens).
    "3-8b": LlamaConfig(vocab_size=128256, d_model=4096, n_heads=32, n_kv_heads=8, n_blocks=32, hidden=14336,
                        seq_len=8192, rope_theta=500000.0),
    "3-70b": LlamaConfig(vocab_size=128256, d_model=8192, n_heads=64, n_kv_heads=8, n_blocks=80, hidden=28672,
                         seq_len=8192, rope_theta=500000.0),
}
"""Named Llama shapes for `llama(size)`."""


def llama(size: str, **overrides) -> Llama:
    """Build a Llama-style decoder of a named size.

    Args:
        size: One of `LLAMA_SIZES` ("tiny", "small", "7b", "3-8b", "3-70b").
        **overrides: LlamaConfig fields to change, e.g. `n_blocks=4`.

    Raises:
        ValueError: for an unknown size.
        TypeError: for an override that is not a LlamaConfig field.
    """
    if size not in LLAMA_SIZES:
        raise ValueError(f"unknown Llama size {size!r}; choose one of {sorted(LLAMA_SIZES)}")
    return Llama(replace_fields(LLAMA_SIZES[size], overrides))
