"""DeepSpeed's `deepspeed.moe`, as far as a dense model needs it: fxzero has no mixture of
experts (expert parallelism), so a script that imports these names for an optional MoE path
runs its dense path unchanged, and building an MoE layer is an error saying so."""

from fxzero.moe import layer, utils  # noqa: E402,F401  (deepspeed.moe.layer.MoE is reached by attribute)
