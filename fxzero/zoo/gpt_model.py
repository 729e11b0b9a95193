"""GPT: a decoder-only transformer (GPT-2 style, pre-norm, learned positions, optional tied head)."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxzero.zoo.common import EXAMPLE_SEED, check_positive, replace_fields

__all__ = ["GPT", "GPTConfig", "GPT_SIZES", "gpt"]


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
        check_positive(
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
            self.lm_head.weight = self.wte.weight
        # Last, after the tie (as fxzero replays it for a model built on the meta device): the
        # tied matrix is drawn twice, as wte's and then as lm_head's, and keeps the second draw.
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2's initialization, applied to every module (children before parents).

        Linear and embedding weights N(0, 0.02), biases zero, LayerNorms one and zero; the two
        projections into the residual stream of each block (attention's and the MLP's)
        N(0, 0.02 / sqrt(2 * n_blocks)), so the stream's variance does not grow with depth. The
        head scores with the small embedding, so an untrained model's loss is near ln(vocab_size).
        """
        std = 0.02
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        if isinstance(module, (CausalSelfAttention, MLP)):  # after their own Linears: this draw wins
            nn.init.normal_(module.proj.weight, mean=0.0, std=std / math.sqrt(2 * self.config.n_blocks))

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
        gen = torch.Generator().manual_seed(EXAMPLE_SEED)
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
    # Untied head: the head and the embedding are two units of 82M parameters each.
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
    return GPT(replace_fields(GPT_SIZES[size], overrides))
