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

Activations are not on the page yet (issue 24's activation controls wait for an estimate of
them in `fxzero.estimate`); the page says so.
"""

from __future__ import annotations

import json
from importlib import resources

from fxzero import estimate
from fxzero.config import Adagrad, Adam

__all__ = ["GB", "GPUS", "MODEL_PRESETS", "OPTIMIZERS", "OFFLOADS", "offload_policy", "render_wall", "wall_data"]

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
    "gpt3-175b": ("GPT-3 175B", 175e9),
    "llama3-8b": ("Llama-3 8B", 8_030_261_248),
    "llama3-70b": ("Llama-3 70B", 70_553_706_496),
    "llama3-405b": ("Llama-3 405B", 405_853_388_800),
}
"""Published parameter counts: GPT-3's paper (175.0B); Llama 3's released checkpoints (8B,
70B, and Llama 3.1's 405B), which their configs' shapes give exactly."""

DEFAULTS = {"params": 7.5e9, "gpus": 64, "gpu": "h100-80", "precision": "mixed", "optimizer": "adam",
            "offload": "none"}
"""The ZeRO paper's Table 1 example (7.5B parameters, 64 GPUs, mixed precision Adam)."""

LIMITS = {"params": [1e9, 1e12], "gpus": [1, 4096]}


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
        "version": 1,
        "unit": {"name": "GB", "bytes": GB},
        "components": list(COMPONENTS),
        "bytes_per_param": {p: {name: list(estimate.bytes_per_param(p, opt)) for name, opt in OPTIMIZERS.items()}
                            for p in estimate.BYTES_PER_PARAM},
        "stages": [{"stage": s, "name": STAGE_NAMES[s], "sharded": _sharded(s)} for s in estimate.STAGES],
        "placement": {o: {str(s): _placement(s, o) for s in estimate.STAGES} for o in OFFLOADS},
        "sum_order": {o: {str(s): _sum_order(s, o) for s in estimate.STAGES} for o in OFFLOADS},
        "gpus": {k: {"label": label, "bytes": b} for k, (label, b) in GPUS.items()},
        "presets": {k: {"label": label, "params": p} for k, (label, p) in MODEL_PRESETS.items()},
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
