"""The optimizer policies: what runs on each rank's flat shards, one frozen dataclass each.

Every policy but LAMB is element-wise: an element's new value depends on that element's
parameter, gradient and states, and on numbers shared by all elements of a parameter (the step
count, the group's hyperparameters). That is what lets a rank update any slice of a flat buffer,
cut anywhere, exactly as torch updates the whole tensors ([Note: torch's arithmetic on a shard]
in `fxzero/runtime/torch_updates.py`). Each declares the states it keeps per element ([Note:
optimizer states] in `policies.py`) and takes its fields' names and defaults from the torch
optimizer it reproduces (`TORCH`), so `fxzero.initialize` reads a client's torch optimizer
field by field and a DeepSpeed config names them as `torch.optim` does.

LAMB (`Lamb`) also needs two numbers of each whole parameter, the norms of its weight and of its
update, for its trust ratio. A flat shard holds pieces of several parameters and most of none,
but a norm is the square root of a sum, and sums add over ranks: each rank sums the squares over
the elements of each parameter it holds, and one small all-reduce per unit (2 numbers per
parameter) gives every rank the whole tensors' norms ([Note: sums over whole parameters] in
`fxzero/runtime/optim.py`). A policy says how many such sums per parameter its update needs in
`WHOLE_PARAMETER_SUMS` (0: element-wise).

Not here, and refused by `fxzero.initialize` with the reason: optimizers that need more of each
parameter than sums of its elements (Adafactor factors each matrix's second moment into row and
column means, Muon orthogonalizes each matrix, LBFGS keeps curvature pairs of the whole
parameter vector, SparseAdam takes sparse gradients), and LAMB or LARS objects of other
libraries, whose formulas differ from DeepSpeed's FusedLamb (`Lamb` is that one; torch.optim has
no LAMB).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping, Optional

__all__ = ["ASGD", "OPTIMIZERS", "Adadelta", "Adagrad", "Adam", "AdamW", "Adamax", "Lamb", "Lion", "NAdam",
           "OptimizerPolicy", "RAdam", "RMSprop", "Rprop", "SGD"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerPolicy:
    """What every optimizer policy declares ([Note: optimizer states] in `policies.py`);
    `Config.optimizer` is one of its subclasses, `OPTIMIZERS`."""

    STATES: ClassVar[tuple[str, ...]] = ()
    """Every state the policy may keep per parameter element (each one fp32 shard per unit), in
    the order the update takes them; `states` is the ones this instance keeps."""
    SCALAR_STATES: ClassVar[tuple[str, ...]] = ()
    """Of `STATES`, those torch keeps as one number per parameter (NAdam's mu_product, ASGD's eta
    and mu): fxzero keeps them per element like the others (every element of a parameter holds its
    parameter's number), so they are sharded, offloaded, checkpointed and re-sliced for another
    world size like any state, at 4 bytes per element each."""
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ("lr",)
    """The options every param group carries (its own, or this policy's), read at each update."""
    TORCH: ClassVar[Optional[str]] = None
    """The `torch.optim` class whose arithmetic this is (fields named as its constructor's
    arguments); None for an update torch does not have (Lion, LAMB)."""
    WHOLE_PARAMETER_SUMS: ClassVar[int] = 0
    """How many sums over each whole parameter's elements the update needs (LAMB: 2, the squared
    norms of the weight and of the update); 0 for an element-wise update. Each costs one number
    per parameter in one all-reduce per unit and step ([Note: sums over whole parameters])."""

    @property
    def states(self) -> tuple[str, ...]:
        return tuple(s for s in type(self).STATES if s in self.uses(self.defaults()))

    def uses(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        """The states the update uses for a param group with these options."""
        return type(self).STATES

    def check_group(self, group: Mapping[str, Any], where: str) -> None:
        """Raise ValueError when a param group's options need a state this policy does not keep
        (the states are decided once, by the policy's own options: a buffer cannot appear later)."""
        missing = [s for s in self.uses(group) if s not in self.states]
        if missing:
            raise ValueError(self._missing_state_message(group, where, missing))

    def _missing_state_message(self, group: Mapping[str, Any], where: str, missing: list[str]) -> str:
        return f"{where} needs the states {missing}, which {type(self).__name__} keeps only by its own options"

    def initial_value(self, state: str) -> float:
        """What `state` holds before the first update: a state never written reads as this."""
        if state not in self.STATES:
            raise ValueError(f"{type(self).__name__} has no state {state!r}; its states are {list(self.STATES)}")
        return 0.0

    def defaults(self) -> dict[str, Any]:
        """The hyperparameters of a param group that sets none of its own: this policy's."""
        out = {k: getattr(self, k) for k in self.HYPERPARAMETERS}
        return {k: tuple(v) if isinstance(v, list) else v for k, v in out.items()}  # betas=[..] as torch keeps it

    def _check_nonnegative(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not value >= 0.0:
                raise ValueError(f"{type(self).__name__}.{name} must be >= 0, got {value}")

    def _check_pair(self, name: str, low: float, high: float) -> None:
        """Two coefficients, each in [low, high)."""
        value = getattr(self, name)
        if len(value) != 2 or not all(low <= b < high for b in value):
            raise ValueError(f"{type(self).__name__}.{name} must be two values in [{low}, {high}), got {value}")


def _momentum_message(policy: OptimizerPolicy, group: Mapping[str, Any], where: str, missing: list[str]) -> str:
    name = type(policy).__name__
    options = {k: group[k] for k in ("momentum", "centered", "amsgrad") if k in group and group[k]}
    fields = ", ".join(f"{k}={v!r}" for k, v in options.items())
    return (f"{where} sets {fields}, which needs the states {missing}, and {name}'s own options keep none: fxzero "
            f"decides the states once, for every parameter, from the optimizer's options. Give them to the "
            f"optimizer itself (torch.optim.{policy.TORCH or name}(..., {fields}) or fxzero.{name}({fields})), and "
            "turn them off in the param groups that should not use them")


# -- the Adam family -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdamW(OptimizerPolicy):
    """AdamW with the semantics of `torch.optim.AdamW` (decoupled weight decay)."""

    STATES: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ("lr", "betas", "eps", "weight_decay", "amsgrad")
    TORCH: ClassVar[Optional[str]] = "AdamW"

    lr: float = 1e-3
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Coefficients of the running averages of the gradient and its square."""
    eps: float = 1e-8
    """Added to the denominator for numerical stability."""
    weight_decay: float = 1e-2
    """Decoupled weight decay, applied as p *= 1 - lr * weight_decay."""
    amsgrad: bool = False
    """AMSGrad: divide by the running maximum of the second moment, kept as a third state
    ("max_exp_avg_sq"); then torch's own update runs (`torch_updates.py`)."""
    bias_correction: bool = True
    """False: the moments are used as they are, without dividing by 1 - beta**step (DeepSpeed's
    FusedAdam / DeepSpeedCPUAdam with "bias_correction": false); torch.optim always corrects."""
    fused: bool = False
    """True: each shard range is updated by torch's fused kernel (`torch.optim.AdamW(fused=True)`,
    which Hugging Face's Trainer uses by default as "adamw_torch_fused"). It rounds differently
    from the for-loop arithmetic (about one ulp a step), so a client's fused optimizer trains as
    under DeepSpeed, which steps it on its flat partitions."""

    def __post_init__(self) -> None:
        self._check_nonnegative("lr")
        self._check_pair("betas", 0.0, 1.0)
        self._check_nonnegative("eps", "weight_decay")
        if self.amsgrad and not self.bias_correction:
            raise ValueError(f"{type(self).__name__}(amsgrad=True, bias_correction=False): torch.optim's AMSGrad "
                             "always corrects the moments' bias; choose one of them")
        if self.fused and not self.bias_correction:
            raise ValueError(f"{type(self).__name__}(fused=True, bias_correction=False): torch's fused kernel "
                             "always corrects the moments' bias; choose one of them")

    def uses(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group.get("amsgrad") else ("exp_avg", "exp_avg_sq")

    _missing_state_message = _momentum_message


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adam(AdamW):
    """Adam with the semantics of `torch.optim.Adam`: weight decay is L2, added to the gradient
    (DeepSpeed's "Adam" with "adam_w_mode": false); otherwise as `AdamW`."""

    TORCH: ClassVar[Optional[str]] = "Adam"

    weight_decay: float = 0.0
    """L2 penalty, added to the gradient as grad + weight_decay * param."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adamax(OptimizerPolicy):
    """`torch.optim.Adamax`: Adam with the infinity norm, `exp_inf = max(beta2 * exp_inf, |grad| + eps)`."""

    STATES: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_inf")
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ("lr", "betas", "eps", "weight_decay")
    TORCH: ClassVar[Optional[str]] = "Adamax"

    lr: float = 2e-3
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Coefficients of the running average of the gradient and of the infinity norm's decay."""
    eps: float = 1e-8
    """Added to |grad| in the infinity norm."""
    weight_decay: float = 0.0
    """L2 penalty, added to the gradient."""

    def __post_init__(self) -> None:
        self._check_nonnegative("lr", "eps", "weight_decay")
        self._check_pair("betas", 0.0, 1.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NAdam(OptimizerPolicy):
    """`torch.optim.NAdam`: Adam with Nesterov momentum and its momentum schedule
    `mu_t = beta1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))`, whose running product
    ("mu_product", one number per parameter in torch) is kept per element."""

    STATES: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq", "mu_product")
    SCALAR_STATES: ClassVar[tuple[str, ...]] = ("mu_product",)
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ("lr", "betas", "eps", "weight_decay", "momentum_decay",
                                                  "decoupled_weight_decay")
    TORCH: ClassVar[Optional[str]] = "NAdam"

    lr: float = 2e-3
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Coefficients of the running averages of the gradient and its square."""
    eps: float = 1e-8
    """Added to the denominator for numerical stability."""
    weight_decay: float = 0.0
    """L2 penalty (or decoupled decay with `decoupled_weight_decay`)."""
    momentum_decay: float = 4e-3
    """psi of the momentum schedule."""
    decoupled_weight_decay: bool = False
    """Apply weight decay as AdamW does (NAdamW) instead of adding it to the gradient."""

    def __post_init__(self) -> None:
        self._check_nonnegative("lr", "eps", "weight_decay", "momentum_decay")
        self._check_pair("betas", 0.0, 1.0)

    def initial_value(self, state: str) -> float:
        super().initial_value(state)
        return 1.0 if state == "mu_product" else 0.0  # (a product of momentum coefficients)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RAdam(OptimizerPolicy):
    """`torch.optim.RAdam`: Adam with the variance rectification term (plain momentum SGD steps
    while the rectified variance is not yet defined)."""

    STATES: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq")
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay")
    TORCH: ClassVar[Optional[str]] = "RAdam"

    lr: float = 1e-3
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Coefficients of the running averages of the gradient and its square."""
    eps: float = 1e-8
    """Added to the denominator for numerical stability."""
    weight_decay: float = 0.0
    """L2 penalty (or decoupled decay with `decoupled_weight_decay`)."""
    decoupled_weight_decay: bool = False
    """Apply weight decay as AdamW does instead of adding it to the gradient."""

    def __post_init__(self) -> None:
        self._check_nonnegative("lr", "eps", "weight_decay")
        self._check_pair("betas", 0.0, 1.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adagrad(OptimizerPolicy):
    """Adagrad with the semantics of `torch.optim.Adagrad` (its single-tensor path): per step
    `clr = lr / (1 + (step - 1) * lr_decay)`, `sum += grad * grad`,
    `param -= clr * grad / (sqrt(sum) + eps)`, with `grad + weight_decay * param` for grad when
    weight_decay is set. One state per element, so 12 bytes per parameter of model states in
    fp32 where AdamW takes 16 (ZeRO-Infinity's other NVMe-aware optimizer)."""

    STATES: ClassVar[tuple[str, ...]] = ("sum",)
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ("lr", "lr_decay", "eps", "weight_decay")
    TORCH: ClassVar[Optional[str]] = "Adagrad"

    lr: float = 1e-2
    """Learning rate (before the decay)."""
    lr_decay: float = 0.0
    """The step-th update runs with lr / (1 + (step - 1) * lr_decay)."""
    weight_decay: float = 0.0
    """L2 penalty, added to the gradient as grad + weight_decay * param."""
    initial_accumulator_value: float = 0.0
    """What the sum of squared gradients starts from (every element; torch reads it from the
    optimizer's defaults, never from a param group, and so does fxzero)."""
    eps: float = 1e-10
    """Added to the denominator for numerical stability."""

    def __post_init__(self) -> None:
        self._check_nonnegative("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")

    def initial_value(self, state: str) -> float:
        super().initial_value(state)  # (a state it has)
        return float(self.initial_accumulator_value)


# -- SGD and the running-average family ------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class SGD(OptimizerPolicy):
    """`torch.optim.SGD`, with momentum, dampening, Nesterov momentum and L2 weight decay. With
    momentum it keeps one state, the momentum buffer, which torch creates at a parameter's first
    step as a copy of its gradient (no dampening on that step): fxzero does the same at a unit's
    first update. Without momentum it keeps none: 8 bytes per parameter of model states in fp32."""

    STATES: ClassVar[tuple[str, ...]] = ("momentum_buffer",)
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    TORCH: ClassVar[Optional[str]] = "SGD"

    lr: float = 1e-3
    """Learning rate."""
    momentum: float = 0.0
    """Momentum factor; 0 keeps no momentum buffer (then no param group may set one)."""
    dampening: float = 0.0
    """Dampening of the momentum: buf = momentum * buf + (1 - dampening) * grad."""
    weight_decay: float = 0.0
    """L2 penalty, added to the gradient."""
    nesterov: bool = False
    """Nesterov momentum (needs momentum > 0 and dampening 0, as torch says)."""

    def __post_init__(self) -> None:
        self._check_nonnegative("lr", "momentum", "weight_decay")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("SGD(nesterov=True) needs momentum > 0 and dampening = 0 (torch.optim.SGD's rule), got "
                             f"momentum={self.momentum}, dampening={self.dampening}")

    def uses(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group.get("momentum") else ()

    _missing_state_message = _momentum_message


@dataclasses.dataclass(frozen=True, kw_only=True)
class RMSprop(OptimizerPolicy):
    """`torch.optim.RMSprop`: the running average of the squared gradient ("square_avg"), with a
    momentum buffer when momentum > 0 and the running average of the gradient ("grad_avg") when
    centered, as torch keeps them."""

    STATES: ClassVar[tuple[str, ...]] = ("square_avg", "momentum_buffer", "grad_avg")
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ("lr", "alpha", "eps", "weight_decay", "momentum", "centered")
    TORCH: ClassVar[Optional[str]] = "RMSprop"

    lr: float = 1e-2
    """Learning rate."""
    alpha: float = 0.99
    """Smoothing constant of the running average of the squared gradient."""
    eps: float = 1e-8
    """Added to the denominator for numerical stability."""
    weight_decay: float = 0.0
    """L2 penalty, added to the gradient."""
    momentum: float = 0.0
    """Momentum factor; 0 keeps no momentum buffer."""
    centered: bool = False
    """Normalize by the estimated variance (keeps "grad_avg")."""

    def __post_init__(self) -> None:
        self._check_nonnegative("lr", "alpha", "eps", "weight_decay", "momentum")

    def uses(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        used = ("square_avg",)
        if group.get("momentum", 0) > 0:
            used += ("momentum_buffer",)
        return used + (("grad_avg",) if group.get("centered") else ())

    _missing_state_message = _momentum_message


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adadelta(OptimizerPolicy):
    """`torch.optim.Adadelta`: running averages of the squared gradient and of the squared update."""

    STATES: ClassVar[tuple[str, ...]] = ("square_avg", "acc_delta")
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ("lr", "rho", "eps", "weight_decay")
    TORCH: ClassVar[Optional[str]] = "Adadelta"

    lr: float = 1.0
    """Coefficient that scales the delta before it is applied."""
    rho: float = 0.9
    """Coefficient of the running averages."""
    eps: float = 1e-6
    """Added inside the square roots for numerical stability."""
    weight_decay: float = 0.0
    """L2 penalty, added to the gradient."""

    def __post_init__(self) -> None:
        self._check_nonnegative("lr", "eps", "weight_decay")
        if not 0.0 <= self.rho <= 1.0:
            raise ValueError(f"Adadelta.rho must be in [0, 1], got {self.rho}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ASGD(OptimizerPolicy):
    """`torch.optim.ASGD`, averaged SGD: the running average of the parameter ("ax") and the
    per-parameter step size "eta" and averaging coefficient "mu" (torch's one number each per
    parameter, kept per element). eta starts as the group's lr at its first step, as in torch."""

    STATES: ClassVar[tuple[str, ...]] = ("ax", "eta", "mu")
    SCALAR_STATES: ClassVar[tuple[str, ...]] = ("eta", "mu")
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ("lr", "lambd", "alpha", "t0", "weight_decay")
    TORCH: ClassVar[Optional[str]] = "ASGD"

    lr: float = 1e-2
    """Learning rate."""
    lambd: float = 1e-4
    """Decay term."""
    alpha: float = 0.75
    """Power of the eta update."""
    t0: float = 1e6
    """The step from which the average starts."""
    weight_decay: float = 0.0
    """L2 penalty, added to the gradient."""

    def __post_init__(self) -> None:
        self._check_nonnegative("lr", "weight_decay")

    def initial_value(self, state: str) -> float:
        """mu starts at 1; eta holds the group's lr from the first update on (this value, the
        policy's lr, is only what it reads as before any update)."""
        super().initial_value(state)
        return {"ax": 0.0, "eta": float(self.lr), "mu": 1.0}[state]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rprop(OptimizerPolicy):
    """`torch.optim.Rprop`: per-element step sizes grown or shrunk by the sign agreement of
    successive gradients ("step_size", which starts at the group's lr at its first step, and
    "prev", the last gradient used)."""

    STATES: ClassVar[tuple[str, ...]] = ("prev", "step_size")
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ("lr", "etas", "step_sizes")
    TORCH: ClassVar[Optional[str]] = "Rprop"

    lr: float = 1e-2
    """The step size every element starts from."""
    etas: tuple[float, float] = (0.5, 1.2)
    """(etaminus, etaplus): the factors a step size is multiplied by."""
    step_sizes: tuple[float, float] = (1e-6, 50.0)
    """(minimal, maximal) step size."""

    def __post_init__(self) -> None:
        self._check_nonnegative("lr")
        if len(self.etas) != 2 or not 0.0 < self.etas[0] < 1.0 < self.etas[1]:
            raise ValueError(f"Rprop.etas must be (etaminus, etaplus) with 0 < etaminus < 1 < etaplus, got {self.etas}")
        if len(self.step_sizes) != 2:
            raise ValueError(f"Rprop.step_sizes must be (minimal, maximal), got {self.step_sizes}")

    def initial_value(self, state: str) -> float:
        super().initial_value(state)
        return float(self.lr) if state == "step_size" else 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Lion(OptimizerPolicy):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), DeepSpeed's
    "Lion" optimizer type with its defaults: `c = beta1 * m + (1 - beta1) * g`,
    `p = p * (1 - lr * weight_decay) - lr * sign(c)`, `m = beta2 * m + (1 - beta2) * g`. One state,
    the momentum "exp_avg". An element whose c is exactly 0 is not moved (sign(0) = 0, as in the
    paper's code; DeepSpeed's CPU and CUDA kernels move it by -lr and +lr)."""

    STATES: ClassVar[tuple[str, ...]] = ("exp_avg",)
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ("lr", "betas", "weight_decay")

    lr: float = 1e-3
    """Learning rate (Lion's is typically 3-10x smaller than AdamW's)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """(beta1: the interpolation the sign is taken of, beta2: the momentum's decay)."""
    weight_decay: float = 0.0
    """Decoupled weight decay, applied as p *= 1 - lr * weight_decay."""

    def __post_init__(self) -> None:
        self._check_nonnegative("lr", "weight_decay")
        self._check_pair("betas", 0.0, 1.0)


# -- LAMB -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Lamb(OptimizerPolicy):
    """LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
    minutes") with the semantics of DeepSpeed 0.19.8's `FusedLamb`, DeepSpeed's "Lamb" optimizer
    type (read from `deepspeed/ops/lamb/fused_lamb.py` and its kernel
    `csrc/lamb/fused_lamb_cuda_kernel.cu`; our own code). Per parameter, at step t::

        m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g * g
        u = m / (sqrt(v) + eps) + weight_decay * p     (eps_inside_sqrt: m / sqrt(v + eps) + ...)
        ratio = |p| / |u|, clamped to [min_coeff, max_coeff]; 1 when |p| or |u| is 0
        p = p - step_size * ratio * u,   step_size = lr * sqrt(1 - beta2**t) / (1 - beta1**t)
                                          (bias_correction; lr without)

    with |.| the norm of the whole tensor (`WHOLE_PARAMETER_SUMS`: computed from shards by one
    all-reduce). As in the kernel, the trust ratio is taken of the uncorrected update and the
    bias correction enters only the step size, and weight decay is inside the update (so inside
    the ratio). DeepSpeed clips by the global norm before the update (the top-level
    "gradient_clipping", `Config.gradient_clipping`) and refuses FusedLamb's own `max_grad_norm`,
    so fxzero has no such field. Its ZeRO optimizers hand FusedLamb each rank's flat partition,
    which makes DeepSpeed's trust ratio one per partition at stages 1-3; fxzero's is the
    per-tensor one at every stage, as DeepSpeed's stage 0 computes it."""

    STATES: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq")
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ("lr", "betas", "eps", "weight_decay", "bias_correction",
                                                  "max_coeff", "min_coeff")
    WHOLE_PARAMETER_SUMS: ClassVar[int] = 2

    lr: float = 1e-3
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Coefficients of the running averages of the gradient and its square."""
    eps: float = 1e-8
    """Added to the denominator: to sqrt(v), or under the square root with `eps_inside_sqrt`."""
    eps_inside_sqrt: bool = False
    """m / sqrt(v + eps) instead of m / (sqrt(v) + eps): FusedLamb's constructor option (one for
    every param group, as there)."""
    weight_decay: float = 0.0
    """Added to the update as weight_decay * p, before the trust ratio (FusedLamb's)."""
    bias_correction: bool = True
    """Scale the step by sqrt(1 - beta2**t) / (1 - beta1**t); False: lr as it is."""
    max_coeff: float = 10.0
    """The largest trust ratio."""
    min_coeff: float = 0.01
    """The smallest trust ratio."""

    def __post_init__(self) -> None:
        self._check_nonnegative("lr", "eps", "weight_decay", "min_coeff")
        self._check_pair("betas", 0.0, 1.0)
        if not self.max_coeff >= self.min_coeff:
            raise ValueError(f"Lamb.max_coeff={self.max_coeff} is below Lamb.min_coeff={self.min_coeff}: the trust "
                             "ratio is clamped to [min_coeff, max_coeff]; give max_coeff >= min_coeff")


OPTIMIZERS: tuple[type[OptimizerPolicy], ...] = (AdamW, Adam, Adamax, NAdam, RAdam, Adagrad, SGD, RMSprop, Adadelta,
                                                 ASGD, Rprop, Lion, Lamb)
"""The optimizer policies fxzero runs (the runtime has the arithmetic of each)."""
