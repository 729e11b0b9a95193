"""Eager, single-process fp32 references that the distributed engine must reproduce.

Both references train with `torch.optim.AdamW` and the textbook loop (`loss.backward();
opt.step(); opt.zero_grad()`), so any difference from the engine is the engine's.

- GPT has no buffers, so data parallelism over equal-sized micro-batches is exactly one model
  over the whole global batch: the mean of the ranks' local mean losses is the global mean
  loss, and the mean of their gradients is its gradient. `eager_gpt_reference` runs that.
- The CNN's BatchNorm makes each rank's forward depend on its own micro-batch and gives each
  rank its own running statistics. `eager_cnn_reference` therefore emulates DDP with
  `broadcast_buffers=False` in one process: one replica per rank, gradients averaged.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxzero.zoo import CNNConfig, GPTConfig

__all__ = [
    "assert_losses_close",
    "assert_state_close",
    "classification_loss",
    "clone_state_dict",
    "default_unit_numels",
    "eager_cnn_reference",
    "eager_data_parallel",
    "eager_gpt_reference",
    "eager_hf_losses",
    "hf_rows",
    "lm_loss",
    "make_cnn_batches",
    "make_gpt_batches",
    "padded_numel",
    "rank_slice",
]

Batch = tuple[torch.Tensor, torch.Tensor]


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: logits (B, T, V) against token ids y (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def classification_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits (B, K) against class labels y (B,)."""
    return F.cross_entropy(logits, y)


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def default_unit_numels(model: nn.Module) -> dict[str, int]:
    """Parameters per unit under the default `fxzero.UnitsPolicy`, from the model alone.

    Written from the policy's documented rule, not from fxzero's code: every item that holds
    parameters of the outermost `nn.ModuleList` / `nn.Sequential` containers is a unit (named by
    its FQN); the other unique parameters (`named_parameters(remove_duplicate=True)`, so a tied
    head counts once) form "root" if registered before the last unit's parameters and
    "root:tail" if after; when nothing precedes the units, the tail is the root. Every
    parameter must be trainable (frozen ones would form `:frozen` units of their own).
    """
    blocks: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        children = list(module.named_children())
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and any(_has_parameters(c) for _, c in children):
            blocks.extend(prefix + name for name, c in children if _has_parameters(c))
            return
        for name, child in children:
            visit(f"{prefix}{name}.", child)

    visit("", model)
    params = list(model.named_parameters(remove_duplicate=True))
    assert all(p.requires_grad for _, p in params), "default_unit_numels handles trainable models only"
    owners = [next((b for b in blocks if fqn.startswith(b + ".")), None) for fqn, _ in params]
    last_block = max((i for i, owner in enumerate(owners) if owner is not None), default=-1)
    numels: dict[str, int] = {}
    for i, ((_, p), owner) in enumerate(zip(params, owners)):
        unit = owner or ("root:tail" if 0 <= last_block < i else "root")
        numels[unit] = numels.get(unit, 0) + p.numel()
    if "root" not in numels and "root:tail" in numels:
        numels["root"] = numels.pop("root:tail")
    return numels


def padded_numel(numel: int, world_size: int) -> int:
    """A unit's flat length: `numel` rounded up to a multiple of the world size (ceil division)."""
    return -(-numel // world_size) * world_size


def make_gpt_batches(cfg: GPTConfig, steps: int, global_batch: int, seed: int) -> list[Batch]:
    """Token batches of a learnable next-token task.

    Each row starts at a random token and follows a fixed random permutation of the vocabulary
    (the token after t is successor[t]) for `seq_len` more tokens; x is the first `seq_len`, y
    the last `seq_len` (x shifted by one), as in language-model training. Learnable, so a model
    that starts at the uniform guess (the zoo GPT's GPT-2 init) has gradients with a signal:
    on uniformly random tokens it could learn nothing, and its gradients would be noise, with
    elements near zero that Adam turns into +-lr steps from rounding alone.

    Args:
        cfg: The model's shape (vocab_size and seq_len are used).
        steps: Number of batches.
        global_batch: Rows per batch, over all ranks.
        seed: Seed of a private generator; the global RNG is not touched.

    Returns:
        `steps` pairs (x, y) of LongTensors of shape (global_batch, seq_len).
    """
    gen = torch.Generator().manual_seed(seed)
    successor = torch.randperm(cfg.vocab_size, generator=gen)
    batches = []
    for _ in range(steps):
        tokens = [torch.randint(0, cfg.vocab_size, (global_batch,), generator=gen)]
        for _ in range(cfg.seq_len):
            tokens.append(successor[tokens[-1]])
        tokens = torch.stack(tokens, dim=1)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return batches


def make_cnn_batches(
    steps: int, global_batch: int, seed: int, cfg: CNNConfig = CNNConfig()
) -> list[Batch]:
    """Random images and class labels.

    Args:
        steps: Number of batches.
        global_batch: Rows per batch, over all ranks.
        seed: Seed of a private generator; the global RNG is not touched.
        cfg: The model's shape (in_channels, image_size, num_classes are used).

    Returns:
        `steps` pairs (x float32 (B, C, H, W), y int64 (B,)).
    """
    gen = torch.Generator().manual_seed(seed)
    shape = (global_batch, cfg.in_channels, cfg.image_size, cfg.image_size)
    return [
        (torch.randn(shape, generator=gen), torch.randint(0, cfg.num_classes, (global_batch,), generator=gen))
        for _ in range(steps)
    ]


def assert_losses_close(got: Sequence[float], want: Sequence[float], what: str, rtol: float = 1e-5) -> None:
    """Per-step losses within `rtol` (no absolute slack), both sequences in the message."""
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=rtol, atol=0, msg=lambda m: f"{what}\ngot  {got}\nwant {want}\n{m}")


def assert_state_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str,
                       atol: float = 1e-5) -> None:
    """The same keys, every tensor within `atol` (no relative slack), naming the first that is not."""
    assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))}"
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=atol,
                                   msg=lambda m, k=k: f"{what}: {k!r} differs\n{m}")


def rank_slice(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank's rows of a global batch: rows [rank * B/W, (rank + 1) * B/W).

    Raises:
        ValueError: if the batch does not split evenly, since uneven micro-batches would make
            the mean of local losses differ from the global loss.
    """
    if t.shape[0] % world_size:
        raise ValueError(
            f"global batch of {t.shape[0]} rows does not split evenly over {world_size} ranks; "
            "use a global batch that is a multiple of the world size"
        )
    local = t.shape[0] // world_size
    return t[rank * local : (rank + 1) * local].contiguous()


def hf_rows(batch: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Rank's rows of every tensor of a keyword batch (`rank_slice`)."""
    return {k: rank_slice(v, rank, world_size) for k, v in batch.items()}


def eager_hf_losses(model: nn.Module, batches: Sequence[dict[str, torch.Tensor]], world_size: int,
                    adamw: dict[str, Any]) -> list[float]:
    """Eager `torch.optim.AdamW(**adamw)` doing what DDP does to a model called the Hugging Face
    way (keyword batches, `labels=` in them): each step the mean over the ranks of the loss of
    their rows (`hf_rows`). The model trains in place; its per-step losses are returned."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), **adamw)
    losses = []
    for batch in batches:
        loss = sum(model(**hf_rows(batch, r, world_size)).loss for r in range(world_size)) / world_size
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def clone_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of module.state_dict(), safe to keep after training continues."""
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def _build(model_fn: Callable[[], nn.Module], state_dict: dict[str, torch.Tensor]) -> nn.Module:
    model = model_fn()
    model.load_state_dict(state_dict)
    return model.train()


def eager_gpt_reference(
    model_fn: Callable[[], nn.Module],
    state_dict: dict[str, torch.Tensor],
    batches: Sequence[Batch],
    adamw_kwargs: Optional[dict[str, Any]] = None,
    *,
    make_optimizer: Optional[Callable[[nn.Module], torch.optim.Optimizer]] = None,
    slices: int | Sequence[int] = 1,
) -> dict[str, Any]:
    """Train one model on the whole global batch of every step.

    Args:
        model_fn: Builds the model (eagerly, on the CPU).
        state_dict: Initial weights, loaded before training.
        batches: (x, y) per step; loss is cross-entropy of logits (B, T, V) against y (B, T).
        adamw_kwargs: Keyword arguments of `torch.optim.AdamW`.
        make_optimizer: Instead, builds the optimizer from the model (another torch.optim class,
            param groups).
        slices: the global batch's gradient as N ranks form it: the mean of the gradients of N
            equal contiguous slices (one number for every step, or one per step). The same
            gradient as the whole batch's up to the order of its sums; where an optimizer
            normalizes by a second moment near zero (AdamW's AMSGrad, NAdam), that order moves an
            element by up to 2e-5 after a few steps on a CPU without AVX-512 (0 on one with it).

    Returns:
        `{"losses": [float per step], "state_dict": final state_dict (CPU copies)}`.
    """
    model = _build(model_fn, state_dict)
    if make_optimizer is not None:
        opt = make_optimizer(model)
    else:
        opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs)
    losses = []
    per_step = [slices] * len(batches) if isinstance(slices, int) else list(slices)
    for (x, y), n in zip(batches, per_step, strict=True):
        if n == 1:
            loss = lm_loss(model(x), y)
            loss.backward()
        else:
            parts = [lm_loss(model(xs), ys) / n for xs, ys in zip(x.chunk(n), y.chunk(n), strict=True)]
            for part in parts:
                part.backward()
            loss = sum(p.detach() for p in parts)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state_dict": clone_state_dict(model)}


def eager_cnn_reference(
    model_fn: Callable[[], nn.Module],
    state_dict: dict[str, torch.Tensor],
    batches: Sequence[Batch],
    world_size: int,
    adamw_kwargs: dict[str, Any],
) -> dict[str, Any]:
    """Emulate DDP (broadcast_buffers=False) over `world_size` ranks in one process.

    Replica r trains on `rank_slice(batch, r, world_size)` with its own mean loss; the
    replicas' gradients are averaged and every replica's own AdamW steps with the average. The
    parameters therefore stay identical across replicas while the BatchNorm running statistics
    follow each replica's micro-batches.

    Args:
        model_fn: Builds the model (eagerly, on the CPU).
        state_dict: Initial weights and buffers, loaded into every replica.
        batches: (x, y) per step, global batches; loss is cross-entropy of logits (B, K) vs y (B,).
        world_size: Number of emulated ranks.
        adamw_kwargs: Keyword arguments of `torch.optim.AdamW`.

    Returns:
        `{"losses": [[loss of rank r for r in ranks] per step],
        "state_dicts": [final state_dict of rank r (CPU copies)]}`.
    """
    replicas = [_build(model_fn, state_dict) for _ in range(world_size)]
    opts = [torch.optim.AdamW(m.parameters(), **adamw_kwargs) for m in replicas]
    params = [list(m.parameters()) for m in replicas]
    losses = []
    for x, y in batches:
        step_losses = []
        for rank, model in enumerate(replicas):
            loss = classification_loss(model(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size))
            loss.backward()
            step_losses.append(loss.item())
        for i in range(len(params[0])):
            grads = [p[i].grad for p in params if p[i].grad is not None]
            if not grads:
                continue
            assert len(grads) == world_size, "replicas disagree on which parameters got a gradient"
            mean = torch.stack(grads).sum(0) / world_size
            for p in params:
                p[i].grad = mean.clone()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(step_losses)
    return {"losses": losses, "state_dicts": [clone_state_dict(m) for m in replicas]}


def eager_data_parallel(model: nn.Module, opt: torch.optim.Optimizer, batch: Callable[[int, int], tuple],
                        steps: int, world: int, before: Optional[Callable[[nn.Module, int], None]] = None
                        ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Data parallelism over `world` ranks of a model without buffers its batch changes, in one
    process: each step `before(model, step)` (the program's own changes between steps), then the
    ranks' micro-batches `batch(step, rank)` concatenated (equal sizes: the mean of the ranks' mean
    losses is the mean over all), one backward and one step of `opt`. The model returns its loss.
    Returns the losses and the final state dict."""
    losses = []
    for step in range(steps):
        if before is not None:
            before(model, step)
        parts = [batch(step, r) for r in range(world)]
        loss = model(*(torch.cat([p[i] for p in parts]) for i in range(len(parts[0]))))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
