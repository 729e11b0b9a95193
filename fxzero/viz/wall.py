"""The Memory Wall page: per-GPU model states for DDP and ZeRO-1/2/3, one offline HTML file.

The arithmetic lives in Python (`fxzero.estimate`: `bytes_per_param`, `paper_model_states`,
`place`, the code behind `fxzero estimate --params`). `wall_data()` reads the rules out of those
functions as plain JSON, and the page (`wall.html`, a template beside this module) evaluates
them in the same order and nothing else:

- `bytes_per_param[precision][optimizer]` = [parameter, gradient, optimizer] bytes per parameter;
- `stages[s].sharded[component]`: whether stage s divides that component by the GPU count;
  a component's bytes are `b * phi / N` when sharded, else `b * phi` (`paper_model_states`);
- `placement[offload][s][component]`: the tier it lives on (`place`, the `--offload` policy of
  `fxzero estimate`), and `sum_order[offload][s]`: the order `place` adds components into a
  tier, so the page's floats equal Python's exactly, not to a rounding.

Each rule is found by calling the Python function, not restated here: `sharded` compares one
rank's bytes on 1 and 2 GPUs, `placement` places one component at a time. tests/cli/test_wall.py
checks the page's numbers against `paper_model_states` + `place` over a grid, in node and in a
real browser.

Activations come from `fxzero.activation_estimate.megatron_per_layer` (Korthikanti et al.
2022), which is linear in two products: per layer = `sbh * s*b*h + as2b * a*s*s*b` bytes.
`activations.coefficients[precision][recompute][attention][dropout]` holds the two numbers, each
read off the Python function (`_activation_coefficients` calls it with h = 1, a = 0 and with
h = 0, a = 1). The page multiplies them out in exact integers (BigInt), as Python's ints do, times
the layers, and turns the result into a float once, where it is added to the model states on the
device (Python's float + int rounds the same way); so the order of the products cannot change a
figure. Activations are per GPU and the same at every stage: each GPU runs its own micro-batch,
and ZeRO shards model states, not activations.
"""

from __future__ import annotations

import json
from importlib import resources

from fxzero import activation_estimate, estimate
from fxzero.config import Adagrad, Adam

__all__ = ["GB", "GPUS", "MODEL_PRESETS", "OPTIMIZERS", "OFFLOADS", "RECOMPUTES", "activation_itemsize",
           "offload_policy", "render_wall", "wall_data"]

GB = 1e9
"""The page's unit: decimal gigabytes, as the ZeRO paper and the vendors' "80 GB"."""

OPTIMIZERS = {"adam": Adam(), "adagrad": Adagrad()}
"""The optimizers the page offers: the paper's Adam (two moments) and Adagrad (one sum)."""

OFFLOADS = ("none", "cpu", "nvme")

COMPONENTS = ("params", "grads", "optimizer")

STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}

GPUS = {
    "a100-40": ("A100 40 GB", 40e9),
    "a100-80": ("A100 80 GB", 80e9),
    "h100-80": ("H100 80 GB", 80e9),
    "h200-141": ("H200 141 GB", 141e9),
    "b200-192": ("B200 192 GB", 192e9),
}
"""Device memory as the vendors state it (decimal GB)."""

MODEL_PRESETS = {
    "gpt3-175b": ("GPT-3 175B", 175e9, {"layers": 96, "hidden": 12288, "heads": 96}),
    "llama3-8b": ("Llama-3 8B", 8_030_261_248, {"layers": 32, "hidden": 4096, "heads": 32}),
    "llama3-70b": ("Llama-3 70B", 70_553_706_496, {"layers": 80, "hidden": 8192, "heads": 64}),
    "llama3-405b": ("Llama-3 405B", 405_853_388_800, {"layers": 126, "hidden": 16384, "heads": 128}),
}
"""Published parameter counts and shapes: GPT-3's paper (175.0B; Table 2.1: 96 layers, d_model
12288, 96 heads); Llama 3's released checkpoints (8B, 70B, and Llama 3.1's 405B), whose configs'
shapes give the counts exactly (num_hidden_layers, hidden_size, num_attention_heads)."""

RECOMPUTES = {"none": "none (every layer keeps all it saves)",
              "unit": "unit (full: each layer keeps its input)",
              "selective": "selective (attention scores recomputed)"}
"""`Activations(recompute=...)`'s choices that Megatron's formula covers."""

DEFAULTS = {"params": 7.5e9, "gpus": 64, "gpu": "h100-80", "precision": "mixed", "optimizer": "adam",
            "offload": "none", "seq": 0, "mb": 1, "layers": 32, "hidden": 4096, "heads": 32, "recompute": "none",
            "fused": 1, "dropout": 1}
"""The ZeRO paper's Table 1 example (7.5B parameters, 64 GPUs, mixed precision Adam), without
activations (seq 0: the page shows model states only); a shape to start from when a sequence is
given (Llama-3 8B's), fused attention (FlashAttention, SDPA) and the paper's dropout masks."""

LIMITS = {"params": [1e9, 1e12], "gpus": [1, 4096], "seq": [0, 1_048_576], "mb": [1, 4096], "layers": [1, 1000],
          "hidden": [1, 1_048_576], "heads": [1, 4096]}
"""Whole numbers past params; seq 0 means no activations."""


def activation_itemsize(precision: str) -> int:
    """Bytes per activation value: the dtype the forward computes in, which is the working copy
    of the parameters (`bytes_per_param`'s first entry: 2 under mixed precision, 4 under fp32)."""
    return int(estimate.bytes_per_param(precision, Adam())[0])


def _activation_coefficients(precision: str, recompute: str, fused: bool, dropout: bool) -> dict[str, int]:
    """Bytes per s*b*h and per a*s^2*b of one layer, read off `megatron_per_layer`."""
    def per_layer(seq, batch, hidden, heads):
        return activation_estimate.megatron_per_layer(seq, batch, hidden, heads, itemsize=activation_itemsize(precision),
                                                      dropout=dropout, fused_attention=fused, recompute=recompute)
    coef = {"sbh": per_layer(1, 1, 1, 0), "as2b": per_layer(1, 1, 0, 1)}
    # Our own invariant: the function is that sum of two products (checked at one uneven point).
    s, b, h, a = 3, 5, 7, 2
    assert per_layer(s, b, h, a) == coef["sbh"] * s * b * h + coef["as2b"] * a * s * s * b, (precision, recompute)
    return coef


def _activations() -> dict:
    flags = {"1": True, "0": False}
    return {
        "source": "fxzero.activation_estimate.megatron_per_layer (Korthikanti et al. 2022)",
        "itemsize": {p: activation_itemsize(p) for p in estimate.BYTES_PER_PARAM},
        "coefficients": {p: {r: {f: {d: _activation_coefficients(p, r, fv, dv) for d, dv in flags.items()}
                                 for f, fv in flags.items()} for r in RECOMPUTES} for p in estimate.BYTES_PER_PARAM},
        "recomputes": dict(RECOMPUTES),
    }


def offload_policy(offload: str):
    """The `fxzero.Offload` the page's offload choice stands for: what `fxzero estimate --offload`
    builds (`fxzero/cli/estimate_cmd.py`'s `offload_policy`, restated here so this module does
    not import the CLI): optimizer states, gradients with them, and at stage 3 parameter shards
    on that tier."""
    from fxzero.config import Cpu, Nvme, Offload

    if offload == "none":
        return None
    placement = Cpu() if offload == "cpu" else Nvme(path="nvme")
    return Offload(params=placement, optimizer=placement)


def _sharded(stage: int) -> dict[str, bool]:
    one, two = (estimate.paper_model_states(1.0, n, stage) for n in (1, 2))
    return {c: getattr(two, c) != getattr(one, c) for c in COMPONENTS}


def _placement(stage: int, offload: str) -> dict[str, str]:
    policy = offload_policy(offload)
    tiers = {}
    for c in COMPONENTS:
        alone = estimate.ModelStates(**{k: (1.0 if k == c else 0.0) for k in COMPONENTS})
        where = estimate.place(alone, stage, policy).to_json()
        (tiers[c],) = [t for t in ("device", "cpu", "nvme") if where[t]]
    return tiers


def _sum_order(stage: int, offload: str) -> list[str]:
    """The order `place` adds components: `states.total` (params + grads + optimizer) when nothing
    is offloaded or at stage 0, else optimizer, gradients, parameters into each tier. Checked
    by the grid test's exact comparison, which fails if `place` changes its order."""
    if offload == "none" or stage == 0:
        return ["params", "grads", "optimizer"]
    return ["optimizer", "grads", "params"]


def wall_data() -> dict:
    """Everything the page computes from, as JSON-able values."""
    return {
        "version": 2,
        "unit": {"name": "GB", "bytes": GB},
        "components": list(COMPONENTS),
        "bytes_per_param": {p: {name: list(estimate.bytes_per_param(p, opt)) for name, opt in OPTIMIZERS.items()}
                            for p in estimate.BYTES_PER_PARAM},
        "stages": [{"stage": s, "name": STAGE_NAMES[s], "sharded": _sharded(s)} for s in estimate.STAGES],
        "placement": {o: {str(s): _placement(s, o) for s in estimate.STAGES} for o in OFFLOADS},
        "sum_order": {o: {str(s): _sum_order(s, o) for s in estimate.STAGES} for o in OFFLOADS},
        "gpus": {k: {"label": label, "bytes": b} for k, (label, b) in GPUS.items()},
        "presets": {k: {"label": label, "params": p, **shape} for k, (label, p, shape) in MODEL_PRESETS.items()},
        "activations": _activations(),
        "optimizers": {"adam": "Adam", "adagrad": "Adagrad"},
        "precisions": {"fp32": "fp32", "mixed": "mixed (bf16/fp16 + fp32 master)"},
        "offloads": {"none": "none", "cpu": "cpu", "nvme": "nvme"},
        "defaults": dict(DEFAULTS),
        "limits": LIMITS,
    }


def render_wall() -> str:
    """The page: the template with `wall_data()` inlined (no external reference of any kind)."""
    template = resources.files("fxzero.viz").joinpath("wall.html").read_text(encoding="utf-8")
    # "</" inside a script element would end it; JSON allows "<\/".
    payload = json.dumps(wall_data(), indent=1).replace("</", "<\\/")
    marker = "/*WALL_DATA*/{}"
    assert template.count(marker) == 1, "wall.html must hold the data marker once"
    return template.replace(marker, payload)
