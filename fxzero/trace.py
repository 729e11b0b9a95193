"""Capture: the joint forward+backward ATen graph of a module, traced on fake tensors.

`trace_joint` traces

    outputs, grads, new_buffers = joint(params, buffers, inputs, grad_outputs)

with `make_fx`: the forward through `torch.func.functional_call`, the backward through
`torch.autograd.grad`. Every tensor is a fake tensor, so no parameter memory is touched and a
model built on the meta device can be traced. A second trace through `functionalize` turns
in-place updates of buffers (BatchNorm running statistics) into explicit graph outputs.

The result is one flat-argument `GraphModule` whose placeholders are tagged in
`node.meta["fxzero"]`:

    {"kind": "param", "fqn": ...}        one per unique parameter (tied parameters count once)
    {"kind": "buffer", "fqn": ...}
    {"kind": "input", "index": i}
    {"kind": "grad_output", "index": i}  one per differentiable output

and whose output is the flat list `[*outputs, *grads, *new_buffers]`, described by a
`JointSignature`.

Sizes ([Note: any size, one program] in `fxzero/ir/shapes.py`). An input dim marked dynamic
(`torch._dynamo.maybe_mark_dynamic` or `mark_dynamic` on the example tensor: the engine marks the
dims a later call changed) is traced as a symbol, so the graph computes every size from its
inputs and runs at any size its guards accept; every other dim is the example's size. Sizes
that depend on the data (`nonzero`, `x[mask]`, `masked_select`, and `index_select` on their
result) are unbacked symbols, in every trace. `TracedJoint.shapes` records the shapes, guards
and the sizes the schedule's figures are evaluated at.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import warnings

import dataclasses
from typing import Any, Collection, Mapping, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from fxzero._compat import (
    DataDependentOutputException,
    DimDynamic,
    DynamicOutputShapeException,
    FakeTensorMode,
    GuardOnDataDependentSymNode,
    ShapeEnv,
    StatelessSymbolicContext,
    backed_hints,
    checkpoint_regions,
    dynamic_dims_of,
    free_unbacked_symbols,
    get_decompositions,
    local_source,
    make_fx,
    pytree,
    size_like_symbols,
    upper_bound,
    where_fixed,
)
from fxzero.ir.hook_ops import hook_key
from fxzero.module_state import StatefulForward, changed, restore, snapshot
from fxzero.ir.shapes import InputShapes
from fxzero.target_device import TargetKernels, check_no_cpu_kernels, retarget
from fxzero.ir.signature import JointSignature, argument_name, flatten_call
from fxzero.ir.sizes import concrete, register_sizes

__all__ = ["DataDependentControlFlow", "DataDependentShape", "StatefulForward", "TracedJoint", "UntraceableDtype", "trace_joint",
           "without_regions"]

# native_batch_norm's schema does not declare that it updates running statistics; its
# decomposition does the update with explicit copy_, which functionalization can see. In eval
# (training=False) nothing is updated, and the op stays whole: eager's fused kernel, whose
# rounding the decomposition's separate ops would not reproduce.
_BATCH_NORM = get_decompositions([torch.ops.aten.native_batch_norm.default])[torch.ops.aten.native_batch_norm.default]


def _batch_norm_when_training(input, weight, bias, running_mean, running_var, training, momentum, eps):
    if not training:
        return NotImplemented
    return _BATCH_NORM(input, weight, bias, running_mean, running_var, training, momentum, eps)


_DECOMPOSITIONS = {torch.ops.aten.native_batch_norm.default: _batch_norm_when_training}


@dataclasses.dataclass
class TracedJoint:
    gm: fx.GraphModule
    signature: JointSignature
    shapes: Optional[InputShapes] = None
    """The input sizes the graph serves and the sizes its figures are for (`ir/shapes.py`)."""


def _fake_like(mode: FakeTensorMode, t: torch.Tensor, requires_grad: bool = False,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A fake CPU tensor with t's shape and dtype, or `dtype` (t may be on the meta device)."""
    with mode:
        out = torch.empty_strided(t.shape, t.stride(), dtype=dtype or t.dtype, device="cpu")
    return out.requires_grad_(requires_grad)


def _available_like(stand_in: torch.Tensor, param: torch.Tensor) -> None:
    """Give a parameter's stand-in in the trace the DeepSpeed attributes `param` has, available:
    in the program every parameter is whole where it is used, so code that checks
    `p.ds_status` before gathering (TRL's fused LM-head loss, PEFT's merge) takes the gathered
    path, where reading the attribute from a plain tensor would fail ([Note: the DeepSpeed
    attributes of a parameter] in `fxzero/runtime/user_module.py`)."""
    status = param.__dict__.get("ds_status")
    if status is None:
        return
    for attr, value in param.__dict__.items():
        if attr.startswith("ds_"):
            setattr(stand_in, attr, value)
    stand_in.ds_status = type(status).AVAILABLE


def _input_fake(mode: FakeTensorMode, t: torch.Tensor, index: int) -> torch.Tensor:
    """A fake CPU input with t's shape and dtype: the dims marked dynamic symbolic, the others
    the example's sizes. Symbolic inputs are traced contiguous (their programs read sizes only)."""
    dims = dynamic_dims_of(t)
    if not dims:
        return _fake_like(mode, t)
    template = torch.empty(t.shape, dtype=t.dtype)  # (a real CPU tensor: t may be meta or fake)
    context = StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(t.dim())])
    return mode.from_tensor(template, symbolic_context=context, source=local_source(f"t{index}"))


def _check_model(model: nn.Module) -> None:
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                raise TypeError(
                    f"module {name or type(model).__name__!r} holds a plain tensor attribute "
                    f"{attr!r}; fxzero traces parameters and buffers only: register it with "
                    f"register_buffer({attr!r}, ...)"
                )


class DataDependentControlFlow(ValueError):
    """The forward reads a tensor's value in Python (`if h.sum() > 0:`, `.item()`, `.tolist()`)."""

    needs_values = True
    """The forward needs the tensors' values, which a trace does not have: an engine at ZeRO-1/2
    runs it eagerly ([Note: gradients from outside the program] in `fxzero/runtime/outside_grads.py`)."""

    def __init__(self, where: str) -> None:
        super().__init__(
            f"the forward reads a tensor's value in Python at {where}: fxzero traces the model once into one static "
            "program on fake tensors, which have shapes but no values, so a Python branch (or loop) on a value "
            "cannot be traced. Move the decision out of the forward (compute it before calling the engine and pass "
            "it as an input, or a Python constant), or express it as tensor operations (torch.where) or torch.cond")
        self.where = where

    def with_rank(self, rank: int) -> "DataDependentControlFlow":
        """The same error, as a rank at run time says it (`[rank N] ...`)."""
        self.args = (f"[rank {rank}] {self.args[0]}",)
        return self


class DataDependentShape(ValueError):
    """A size that depends on the data is used where fxzero's trace cannot follow it: an operator
    whose output size no rule gives, a Python decision on the count `nonzero` or a boolean mask
    selected, or a differentiable output of such a size. (The engine says which rank.)"""

    needs_values = True
    """As `DataDependentControlFlow.needs_values`."""

    def __init__(self, where: str, what: str = "") -> None:
        super().__init__(
            f"{what or 'a size that depends on the tensor values'} at {where}: fxzero traces the model once, on fake "
            "tensors that have shapes but no values, and follows a data-dependent size only through operators "
            "(nonzero, x[mask], masked_select, index_select on their result), not through a Python decision or an "
            "operator without a size rule. Ways out: let the size flow through those operators instead of deciding "
            "on it (they work on any count, none included), and return a reduced value (a loss) rather than the "
            "selected rows; or a fixed-size formulation: keep every position and mask the ones that do not count "
            "(torch.where(mask, x, 0); labels -100 there, with cross_entropy's ignore_index=-100)")
        self.where = where

    def with_rank(self, rank: int) -> "DataDependentShape":
        self.args = (f"[rank {rank}] {self.args[0]}",)
        return self


class UntraceableDtype(ValueError):
    """An operator whose tracing rule takes fewer dtypes than the kernel a run of the model uses:
    torch's grouped matmul, whose rule is CUDA's kernel's (bfloat16 only) on every device, where
    the CPU kernel also computes float32 (Hugging Face's mixtures of experts call it by default).
    (The engine says which rank.)"""

    def __init__(self, where: str, dtype: torch.dtype) -> None:
        name = str(dtype).removeprefix("torch.")
        super().__init__(
            f"the forward calls torch's grouped matmul (torch._grouped_mm, F.grouped_mm) in {name} at {where}: its "
            f"tracing rule takes bfloat16 only (CUDA's kernel's rule, which torch applies on every device), so fxzero "
            f"cannot trace it in {name}, though torch's CPU kernel computes it. Train in bfloat16 "
            "(fxzero.Config(mixed_precision=fxzero.MixedPrecision()), or DeepSpeed's \"bf16\": {\"enabled\": true}); "
            "or, for a Hugging Face mixture of experts (Mixtral, Qwen MoE, OLMoE), call "
            "model.set_experts_implementation(\"batched_mm\") before compiling: the same arithmetic as batched "
            "matmuls, in any dtype")
        self.where, self.dtype = where, dtype

    def with_rank(self, rank: int) -> "UntraceableDtype":
        self.args = (f"[rank {rank}] {self.args[0]}",)
        return self


def _grouped_mm_dtype(e: RuntimeError) -> Optional[torch.dtype]:
    """The dtype torch's grouped matmul was refused in, where `e` is that refusal (its meta
    kernel's check); else None."""
    tb, refused = e.__traceback__, False
    while tb is not None:
        refused = refused or tb.tb_frame.f_code.co_name == "_meta_grouped_mm_common"
        tb = tb.tb_next
    message = str(e)
    if not (refused and message.startswith("Expected inputs of BF16 type")):
        return None
    name = message.rsplit("mat_a.dtype=", 1)[-1].split(" ", 1)[0]
    return getattr(torch, name.removeprefix("torch."), None) or torch.float32


class _ExplainedMetaFailures(logging.Filter):
    """Drops the fake tensor mode's log of a meta kernel's failure that `UntraceableDtype`
    explains (torch logs each failure with its whole stack before raising it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, RuntimeError) and _grouped_mm_dtype(error) is not None)


@contextlib.contextmanager
def _explains_data_dependence(shape_env: Optional[ShapeEnv] = None):
    """Trace errors said in the model's terms: data-dependent sizes and values, and an operator
    refused in its dtype (`UntraceableDtype`)."""
    fake_log, explained = logging.getLogger("torch._subclasses.fake_tensor"), _ExplainedMetaFailures()
    fake_log.addFilter(explained)
    try:
        yield
    except DynamicOutputShapeException as e:
        where = _users_line(e.__traceback__)
        raise DataDependentShape(where, f"the forward calls {e.func}, whose output size depends on the tensor "
                                        "values and has no size rule in the tracer,") from e
    except GuardOnDataDependentSymNode as e:
        where = _users_line(e.__traceback__)
        symbols = getattr(e.cond, "free_symbols", set())
        if shape_env is not None and symbols & size_like_symbols(shape_env):
            raise DataDependentShape(where, "the forward decides in Python on a size that depends on the data (how "
                                            "many elements nonzero or a boolean mask selected)") from e
        raise DataDependentControlFlow(where) from e
    except DataDependentOutputException as e:
        raise DataDependentControlFlow(_users_line(e.__traceback__)) from e
    except RuntimeError as e:
        dtype = _grouped_mm_dtype(e)
        if dtype is None:
            raise
        raise UntraceableDtype(_users_line(e.__traceback__), dtype) from e
    finally:
        fake_log.removeFilter(explained)


def _users_line(tb) -> str:
    """The innermost frame of the traceback outside torch and fxzero: the model's own line."""
    import linecache
    import os

    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))
    where = "an unknown line"
    while tb is not None:
        code = tb.tb_frame.f_code
        if not code.co_filename.startswith(skip) and "<" not in code.co_filename:
            line = linecache.getline(code.co_filename, tb.tb_lineno).strip()
            where = f"{code.co_filename}:{tb.tb_lineno} in {code.co_name} (`{line}`)"
        tb = tb.tb_next
    return where


def _is_cache(x: Any) -> bool:
    """A Hugging Face KV cache (`transformers.Cache`), which a training step cannot use."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(x).__mro__)


def _constant(x: Any) -> bool:
    return x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device))


def trace_joint(model: nn.Module, example_inputs: Sequence[Any], *, kwargs: Optional[Mapping[str, Any]] = None,
                param_dtype: Optional[torch.dtype] = None, forward_only: bool = False,
                trainable: Optional[Collection[str]] = None, device: Any = "cpu",
                scopes: Collection[str] = ()) -> TracedJoint:
    """Trace the joint forward+backward graph of `model` called as `model(*example_inputs, **kwargs)`.

    The call's tensor leaves are the graph's inputs; its other leaves (bools, ints, strings,
    None) are constants of this trace, so each structure and set of constants is its own program
    (`fxzero.ir.signature`). Outputs may be any structure of tensors (tuples, dicts, dataclass
    outputs such as transformers' `ModelOutput`): `JointSignature.out_spec` rebuilds it. An output
    leaf that is a constant is returned as that constant; a KV cache (or any other object) is
    dropped, returned as None, with a one-time warning naming it.

    Args:
        model: the module; its parameters and buffers may live on the meta device.
        example_inputs, kwargs: the call's arguments; tensors (real, meta or fake) give the
            inputs' shapes and dtypes.
        param_dtype: trace with the floating point parameters in this dtype, and floating
            inputs cast to it in the graph (mixed precision); None: the model's own dtypes.
        forward_only: trace the forward alone, as under `torch.no_grad()`: no parameter is
            trainable, no output needs a gradient, so the graph has no backward.
        trainable: the parameters the units train (None: those that require grad); one of them
            that no longer requires grad gets no gradient (`gradless_fqns`), as torch leaves it.
        device: the device the program runs on: its kernels and allocations are that device's,
            traced on fake CPU tensors ([Note: tracing for a device] in `fxzero/target_device.py`).
        scopes: module FQNs whose forward is a recompute region (`node.meta["fxzero_scope"]`, [Note:
            recompute regions]); the model's own torch.utils.checkpoint calls are regions too.

    Raises:
        TypeError: for argument leaves that are neither tensors nor constants. (An input that
            requires grad gets its gradient: [Note: inputs that require grad] in
            `fxzero/ir/signature.py`.)
        ValueError: if the forward mutates a parameter or an input.
        DataDependentControlFlow: for a Python decision on a tensor's value, naming the line;
            `DataDependentShape` where a size that depends on the data cannot be followed.
        StatefulForward: the forward changes its modules' attributes on every call ([Note: a
            forward that changes its module's state] in `fxzero/module_state.py`); the modules'
            attributes are left as they were before the trace.
    """
    before = snapshot(model)
    try:
        return _trace_joint(model, example_inputs, kwargs, param_dtype, forward_only, trainable, device, scopes)
    except BaseException:  # (the trace's runs of the forward leave the modules as the caller gave them)
        restore(model, before)
        raise


def gradient_hooks(params: Mapping[str, nn.Parameter], wanted: Collection[str]) -> dict[str, list]:
    """[Note: gradient hooks on parameters]
    A hook the user registered on a parameter (`p.register_hook(fn)`: a gradient mask that trains
    only some rows of an embedding, gradient noise, a per-parameter clip) changes the gradient the
    backward computes for it, before it is accumulated. The trace runs the forward on stand-ins
    for the parameters, so the hooks registered on the parameters themselves never ran: the
    gradients were the unhooked ones, without a word. Each is registered on its parameter's stand-in
    in the joint trace as a call of `fxzero::grad_hook` (`fxzero/ir/hook_ops.py`), which
    `autograd.grad` runs where torch's backward runs the hook: the backward program holds one node
    per hook, on the gradient as computed, in the order registered, and at run time the node calls
    the user's function on the real gradient (so a mask it closes over, Python, logging all run as
    under torch; under mixed precision it sees the compute-dtype gradient, as under DeepSpeed's
    cast model). The engine traces again when a parameter's hooks change (`hook_ops.hooks_signature`). A
    parameter that requires no gradient gets none and its hooks do not run, as in torch.

    Hooks that run after the gradient is accumulated into `.grad`
    (`register_post_accumulate_grad_hook`, an optimizer stepping in the backward) have nothing to
    run on: fxzero accumulates into its own shards, and `.grad` stays None. They are refused."""
    post = sorted(f for f, p in params.items() if getattr(p, "_post_accumulate_grad_hooks", None))
    if post:
        raise ValueError(
            f"parameters {post[:3]}{' ...' if len(post) > 3 else ''} have post-accumulate-grad hooks "
            "(register_post_accumulate_grad_hook): fxzero accumulates gradients into its own shards and never into "
            "p.grad, so they would never run. Remove them; to update in the backward use "
            "fxzero.Offload(step_in_backward=True), to change a gradient use p.register_hook(fn)")
    return {f: list(p._backward_hooks.values()) for f, p in params.items()
            if f in wanted and getattr(p, "_backward_hooks", None)}


def _run_hook(key: int, grad: torch.Tensor) -> torch.Tensor:
    return torch.ops.fxzero.grad_hook(grad, key)


def _trace_joint(model: nn.Module, example_inputs: Sequence[Any], kwargs: Optional[Mapping[str, Any]],
                 param_dtype: Optional[torch.dtype], forward_only: bool, trainable: Optional[Collection[str]],
                 device: Any, scopes: Collection[str]) -> TracedJoint:
    _check_model(model)
    leaves, in_spec = flatten_call(example_inputs, kwargs)
    tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    paths = [path for path, _ in pytree.tree_flatten_with_path((tuple(example_inputs), dict(kwargs or {})))[0]]
    for i, x in enumerate(leaves):
        where = argument_name(paths[i])
        if not isinstance(x, torch.Tensor) and not _constant(x):
            raise TypeError(
                f"input {where} is a {type(x).__name__}; fxzero traces tensors and constants (bool, int, float, "
                "str, None) only: pass other arguments through the module's constructor"
            )
    example_tensors = [leaves[i] for i in tensor_at]
    # ([Note: inputs that require grad]) the tensor inputs whose gradients the backward returns
    input_grads = () if forward_only else tuple(i for i, x in enumerate(example_tensors) if x.requires_grad)

    params = dict(model.named_parameters(remove_duplicate=True))
    buffers = dict(model.named_buffers(remove_duplicate=True))
    param_fqns = tuple(params)
    planned = {f for f, p in params.items() if p.requires_grad} if trainable is None else set(trainable)
    trainable = tuple(f for f in params if f in planned and not forward_only)
    wanted = {f for f in trainable if params[f].requires_grad}  # (frozen since the units were planned: no grad)
    buffer_fqns = tuple(buffers)
    # A ShapeEnv in every trace: symbolic input dims, and the unbacked sizes of data-dependent
    # operators (nonzero), which a fake mode without one refuses. Without duck sizing, two dims
    # of equal example size are the same symbol only where the model makes them so.
    shape_env = ShapeEnv(duck_shape=False)
    mode = FakeTensorMode(allow_non_fake_inputs=False, shape_env=shape_env)
    # The inputs are made once (never differentiated, never mutated): both traces below see the
    # same symbols, so the grad_outputs' sizes are in the inputs' symbols.
    fake_inputs = [_input_fake(mode, x, i) for i, x in enumerate(example_tensors)]
    symbolic = any(isinstance(d, torch.SymInt) for x in fake_inputs for d in x.shape)

    def fresh_args() -> tuple[list, list, list]:
        fp = [_fake_like(mode, p, f in wanted, param_dtype if p.is_floating_point() else None)
              for f, p in params.items()]
        fb = [_fake_like(mode, b) for b in buffers.values()]
        fi = [x.detach().requires_grad_(True) if i in input_grads else x for i, x in enumerate(fake_inputs)]
        return fp, fb, fi

    def forward(fp: list, fb: list, fi: list) -> Any:
        if param_dtype is not None:  # the cast is a node of the graph, at the forward's start
            fi = [x.to(param_dtype) if x.is_floating_point() else x for x in fi]
        call = list(leaves)
        for i, x in zip(tensor_at, fi):
            call[i] = x
        args, kw = pytree.tree_unflatten(call, in_spec)
        for fqn, stand_in in zip(param_fqns, fp):
            _available_like(stand_in, params[fqn])
        state = {**dict(zip(param_fqns, fp)), **dict(zip(buffer_fqns, fb))}
        return torch.func.functional_call(model, state, args, kw, strict=True)

    def output_leaves(out: Any) -> tuple[list, Any]:
        return pytree.tree_flatten(out, is_leaf=_is_cache)

    # A fake forward first, to learn the outputs' structure and which need a grad_output.
    # Everything runs under the fake mode, so tensors the forward creates itself
    # (torch.arange for positions, masks) are fake too. (Its data-dependent sizes are
    # discarded: the joint trace makes its own.) With symbolic sizes it runs under make_fx as
    # the joint trace does: an operator torch implements in C++ from concrete sizes (F.pad) is
    # decomposed there into ones that keep sizes symbolic, where the fake mode alone would
    # specialize them to the example's.
    fp, fb, fi = fresh_args()
    kernels = TargetKernels(device)
    regions = _Regions(model, scopes)
    with kernels, regions.installed(), mode, torch.enable_grad(), _explains_data_dependence(shape_env), \
            shape_env.ignore_fresh_unbacked_symbols():
        if symbolic:
            found: list = []

            def outputs(*flat: torch.Tensor) -> list:
                found.append(output_leaves(forward(list(flat[: len(fp)]), list(flat[len(fp) : len(fp) + len(fb)]),
                                                   list(flat[len(fp) + len(fb) :]))))
                return [o for o in found[0][0] if isinstance(o, torch.Tensor)]

            make_fx(outputs, decomposition_table=_DECOMPOSITIONS, tracing_mode="symbolic")(*fp, *fb, *fi)
            out_all, out_spec = found[0]
        else:
            out_all, out_spec = output_leaves(forward(fp, fb, fi))
    after_first = snapshot(model)  # ([Note: a forward that changes its module's state])
    constants: dict[int, Any] = {}
    dropped = []
    out_paths = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(
        pytree.tree_unflatten(list(range(len(out_all))), out_spec))[0]]
    for i, o in enumerate(out_all):
        if isinstance(o, torch.Tensor):
            continue
        constants[i] = o if _constant(o) else None
        if not _constant(o):
            dropped.append(f"output{out_paths[i]} (a {type(o).__name__})")
    if dropped:
        _warn_dropped(model, dropped)
    out_flat = [o for o in out_all if isinstance(o, torch.Tensor)]
    differentiable = tuple(bool(o.requires_grad) for o in out_flat)
    _check_output_sizes(out_flat, differentiable, out_paths, [i for i in range(len(out_all)) if i not in constants])
    with mode:
        grad_outputs = [torch.empty_like(o).detach() for o, d in zip(out_flat, differentiable) if d]

    fp, fb, fi = fresh_args()
    n_p, n_b, n_i = len(fp), len(fb), len(fi)
    hooks = gradient_hooks(params, wanted)

    def joint(*flat: torch.Tensor) -> list:
        p, b = list(flat[:n_p]), list(flat[n_p : n_p + n_b])
        x, g = list(flat[n_p + n_b : n_p + n_b + n_i]), list(flat[n_p + n_b + n_i :])
        for fqn, stand_in in zip(param_fqns, p):  # ([Note: gradient hooks on parameters])
            for hook in hooks.get(fqn, ()):
                stand_in.register_hook(functools.partial(_run_hook, hook_key(hook)))
        with torch.enable_grad():
            outs = [o for o in output_leaves(forward(p, b, x))[0] if isinstance(o, torch.Tensor)]
            diff_outs = [o for o, d in zip(outs, differentiable) if d]
            wrt = [t for t, f in zip(p, param_fqns) if f in wanted] + [x[i] for i in input_grads]
            grads = list(torch.autograd.grad(diff_outs, wrt, g, allow_unused=True)) if wrt and diff_outs else [None] * len(wrt)
            of_inputs = grads[len(grads) - len(input_grads):]
            grads = [grads.pop(0) if f in wanted else None for f in trainable]
        return [*outs, *grads, *of_inputs]

    flat_args = [*fp, *fb, *fi, *grad_outputs]
    # "symbolic" records how each size is computed from the inputs (aten.sym_size nodes).
    tracing_mode = "symbolic" if symbolic else "real"
    tagged = regions.seen  # (units to recompute, or the model's own checkpoint calls, met in the fake forward)
    with mode, regions.installed(), regions.tagging(tagged):
        with kernels, _explains_data_dependence(shape_env):
            gm_mutating = make_fx(joint, decomposition_table=_DECOMPOSITIONS, tracing_mode=tracing_mode)(*flat_args)
        if symbolic or _mutates(gm_mutating) or _has_unbacked(gm_mutating):
            detached = [t.detach() for t in flat_args]
            # (tagged, through an Interpreter, which hands each node's metadata to the nodes it becomes)
            mutating = (lambda *a: fx.Interpreter(gm_mutating).run(*a)) if tagged else gm_mutating
            gm = make_fx(torch.func.functionalize(mutating, remove="mutations"), tracing_mode=tracing_mode)(*detached)
        else:  # [Note: a trace with nothing to functionalize]
            gm = gm_mutating
    changes = changed(after_first, snapshot(model))
    if changes:
        raise StatefulForward(changes)
    if tagged:
        _region_tags(gm)

    _inline_constants(gm)
    retarget(gm, device)
    check_no_cpu_kernels(gm, device)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tags = (
        [{"kind": "param", "fqn": f} for f in param_fqns]
        + [{"kind": "buffer", "fqn": f} for f in buffer_fqns]
        + [{"kind": "input", "index": i} for i in range(n_i)]
        + [{"kind": "grad_output", "index": i} for i in range(len(grad_outputs))]
    )
    assert len(placeholders) == len(tags), (len(placeholders), len(tags))
    for node, tag in zip(placeholders, tags):
        node.meta["fxzero"] = tag

    results = list(next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0])
    grad_results = results[len(out_flat) : len(out_flat) + len(trainable)]
    gradless = tuple(f for f, g in zip(trainable, grad_results) if g is None)
    if input_grads:  # (an input the outputs do not depend on keeps no gradient, as autograd leaves it None)
        output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        head, tail = list(output.args[0][: -len(input_grads)]), list(output.args[0][-len(input_grads):])
        input_grads = tuple(i for i, g in zip(input_grads, tail) if g is not None)
        output.args = (head + [g for g in tail if g is not None],)
    mutated = _buffer_mutations_to_outputs(gm, n_out=len(out_flat) + len(trainable), n_after=len(input_grads))
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    signature = JointSignature(
        param_fqns=param_fqns,
        trainable_fqns=trainable,
        buffer_fqns=buffer_fqns,
        num_inputs=n_i,
        out_spec=out_spec,
        num_outputs=len(out_flat),
        differentiable=differentiable,
        mutated_buffers=mutated,
        gradless_fqns=gradless,
        constant_outputs=tuple(sorted(constants.items())),
        input_grads=input_grads,
    )
    marked = [dynamic_dims_of(x) for x in example_tensors]
    shapes = (_input_shapes(shape_env, fake_inputs, gm, marked) if symbolic or _has_unbacked(gm)
              else InputShapes.static(fake_inputs))
    return TracedJoint(gm, signature, shapes)


_SCOPE = "fxzero_scope"
_SCOPES = "fxzero_scopes"
"""The regions a node was made in, outermost first (its `_SCOPE` is the last): a unit's forward
may run inside the model's own checkpoint call, or hold one."""


class _Regions:
    """[Note: recompute regions] While tracing, every node made inside a region carries the
    region's name (`node.meta["fxzero_scope"]`), and separate_phases recomputes a region's
    interior in the backward ([Note: recomputing a unit] in `fxzero/config/activations.py`). The
    regions: the forward of each module in `units` (under `Activations(recompute="unit")`), and
    each call of `torch.utils.checkpoint.checkpoint`, the model's own activation checkpointing
    (Hugging Face's `gradient_checkpointing_enable()`, `fxzero.checkpointing.checkpoint`, which
    is DeepSpeed's `deepspeed.checkpointing.checkpoint`). Such a call runs its function plainly
    while tracing: the program recomputes its region, by the rule every region follows, instead
    of torch's saved-tensor hooks running the function again outside the traced forward.

    The name travels in the "custom" metadata torch's tracer copies onto each node it makes
    (`_region_tags` moves it), which it does only under `preserve_node_meta`: `tagging`."""

    def __init__(self, model: nn.Module, units: Collection[str]) -> None:
        self.model, self.units = model, tuple(units)
        self.stack: list[str] = []
        self.calls = 0
        self.seen = bool(self.units)

    def _show(self) -> None:
        from torch.fx import traceback as fx_traceback

        meta = fx_traceback.get_current_meta()
        if self.stack:
            meta["custom"] = {_SCOPE: self.stack[-1], _SCOPES: tuple(self.stack)}
        else:
            meta.pop("custom", None)

    def enter(self, name: str) -> None:
        self.seen = True
        self.stack.append(name)
        self._show()

    def leave(self) -> None:
        self.stack.pop()
        self._show()

    def _checkpoint_call(self) -> None:
        self.calls += 1
        self.enter(f"checkpoint:{self.calls}")

    @contextlib.contextmanager
    def installed(self):
        """Hooks on the unit modules and torch.utils.checkpoint's calls as regions (`_compat`)."""
        modules = dict(self.model.named_modules())
        handles = []
        for name in self.units:
            handles.append(modules[name].register_forward_pre_hook(lambda m, a, name=name: self.enter(name)))
            handles.append(modules[name].register_forward_hook(lambda m, a, o: self.leave()))
        self.calls = 0
        try:
            with checkpoint_regions(self._checkpoint_call, self.leave):
                yield
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def tagging(self, on: bool):
        if not on:
            yield
            return
        from torch.fx import traceback as fx_traceback

        with fx_traceback.preserve_node_meta():
            yield


def without_regions(traced: TracedJoint, scopes: Collection[str]) -> TracedJoint:
    """`traced` as traced without `scopes` among its recompute regions: a copy whose nodes made
    in those regions carry the name of the region around them, if any (a model's own
    checkpoint call), else none. A region only names the nodes its forward makes ([Note:
    recompute regions]): the operators are the same, so one trace with every unit a region
    serves each activation policy (`fxzero plan` compiles several of one trace)."""
    gm = copy.deepcopy(traced.gm)
    dropped = set(scopes)
    for node in gm.graph.nodes:
        if _SCOPES not in node.meta:
            continue
        kept = tuple(s for s in node.meta.pop(_SCOPES) if s not in dropped)
        del node.meta[_SCOPE]
        if kept:
            node.meta[_SCOPE], node.meta[_SCOPES] = kept[-1], kept
    return dataclasses.replace(traced, gm=gm)


def _mutates(gm: fx.GraphModule) -> bool:
    """[Note: a trace with nothing to functionalize]
    The joint trace records the operators autograd and the model ran, in-place ones included
    (dropout's `bernoulli_`, a buffer's `add_`, `copy_`); functionalizing it is a second trace
    that rewrites them out of place. A joint graph with no operator whose schema mutates an
    argument has nothing to rewrite: its retrace was the same graph, node for node (measured on
    every model of tests/compile, HF's GPT-2, Llama and BERT; the only difference was a default
    keyword, `attn_mask=None`, spelled out), at about 0.5 s of a 1 s compile of gpt-tiny, so the
    first trace is kept. A symbolic trace (dynamic shapes) or one with data-dependent sizes is
    retraced as before: the retrace names its sizes afresh, which `_input_shapes` reads."""
    return any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
               for n in gm.graph.nodes)


def _region_tags(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        custom = node.meta.pop("custom", None)
        if custom and _SCOPE in custom:
            node.meta[_SCOPE], node.meta[_SCOPES] = custom[_SCOPE], custom[_SCOPES]


def _check_output_sizes(outs: list, differentiable: tuple, paths: list[str], positions: list[int]) -> None:
    """A differentiable output whose size depends on the data has a gradient of a size the
    trace cannot give its placeholder: refuse it, naming the output and the ways out."""
    for o, d, at in zip(outs, differentiable, positions):
        if d and free_unbacked_symbols(o.shape):
            raise DataDependentShape(
                f"output{paths[at]}", "the model returns a differentiable tensor whose size depends on the data "
                f"(shape {tuple(o.shape)}, from nonzero or a boolean mask)")


def _has_unbacked(gm: fx.GraphModule) -> bool:
    return any(free_unbacked_symbols(n.meta.get("val")) for n in gm.graph.nodes if "val" in n.meta)


def _input_shapes(shape_env: ShapeEnv, fake_inputs: list, gm: fx.GraphModule, marked: list) -> InputShapes:
    """The inputs' shapes (a dim the trace specialized is its size, and says where), the guards
    torch recorded (strides left out: [Note: any size, one program]), and the sizes the figures
    are for, which are registered so `fxzero.ir.sizes` evaluates the graph's sizes at them."""
    shapes, specialized = [], []
    for i, x in enumerate(fake_inputs):
        dims = []
        for d, n in enumerate(x.shape):
            expr = shape_env.replace(n.node.expr) if isinstance(n, torch.SymInt) else n
            dims.append(int(expr) if getattr(expr, "is_number", True) else str(expr))
            if d in marked[i] and isinstance(dims[-1], int):
                specialized.append((i, d, where_fixed(shape_env, f"L['t{i}'].size()[{d}]") or "an unknown place"))
        shapes.append(tuple(dims))
    guards = []
    if any(isinstance(d, str) for dims in shapes for d in dims):
        produced = shape_env.produce_guards(fake_inputs, [local_source(f"t{i}") for i in range(len(fake_inputs))],
                                            ignore_static=False)
        guards = [g for g in produced if ".stride()" not in g and ".storage_offset()" not in g]
    sizes = backed_hints(shape_env)
    estimated = _estimate_data_dependent(shape_env, gm, sizes)
    register_sizes(shape_env, {**sizes, **estimated})
    named = {str(s): v for s, v in sizes.items() if any(str(s) in dims for dims in shapes)}
    named.update({str(s): v for s, v in estimated.items()})
    return InputShapes.traced(shapes, guards, named, [str(s) for s in estimated], specialized)


def _estimate_data_dependent(shape_env: ShapeEnv, gm: fx.GraphModule, sizes: dict) -> dict:
    """Each unbacked size (nonzero's count) at its largest: the most elements of the tensors the
    node that made it reads (every element selected), or its range's upper bound if smaller. An
    upper bound, so the memory timeline and cost estimates never undercount."""
    register_sizes(shape_env, sizes)
    estimated: dict = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        new = [u for u in free_unbacked_symbols(val) if u not in estimated] if val is not None else []
        if not new:
            continue
        reads = [i.meta.get("val") for i in node.all_input_nodes]
        largest = max((concrete(r.numel()) for r in reads if isinstance(r, torch.Tensor)), default=None)
        for u in new:
            candidates = [v for v in (largest, upper_bound(shape_env, u)) if v is not None]
            estimated[u] = min(candidates) if candidates else 1
        register_sizes(shape_env, estimated)
    return estimated


_WARNED_DROPPED: set = set()


def _warn_dropped(model: nn.Module, dropped: list[str]) -> None:
    key = (type(model).__name__, tuple(dropped))
    if key in _WARNED_DROPPED:
        return
    _WARNED_DROPPED.add(key)
    warnings.warn(
        f"{type(model).__name__} returns {', '.join(dropped)}, which a training step cannot use (a KV cache, or "
        "another object); fxzero returns None in its place. For a Hugging Face model pass use_cache=False "
        "(or set model.config.use_cache = False) to not build it", stacklevel=4)


def _inline_constants(gm: fx.GraphModule) -> None:
    """Replace the tensor constants the forward made from Python values (an empty KV cache's
    `torch.tensor([])`, a `torch.tensor(-inf)`) by nodes that create them, so every program is
    one graph of operators: `empty` for no elements, `full` for one value repeated.

    Raises:
        ValueError: for a constant holding several values (`torch.tensor([1., 2.])` in the
            forward), naming its shape; register such a tensor as a buffer.
    """
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target)
        if not isinstance(value, torch.Tensor):
            continue
        shape, options = list(value.shape), {"dtype": value.dtype, "device": torch.device("cpu")}
        flat = value.reshape(-1)
        if flat.numel() and not bool((flat == flat[0]).all()):
            raise ValueError(
                f"the forward makes a constant tensor of shape {tuple(shape)} from Python data (torch.tensor([...]) "
                "of several values); fxzero cannot shard or place it: register it with register_buffer in the "
                "module's __init__ and read the buffer in forward"
            )
        with gm.graph.inserting_before(node):
            if flat.numel() == 0:
                made = gm.graph.call_function(torch.ops.aten.empty.memory_format, (shape,), options)
            else:
                made = gm.graph.call_function(torch.ops.aten.full.default, (shape, flat[0].item()), options)
        made.meta = dict(node.meta)
        node.replace_all_uses_with(made)
        gm.graph.erase_node(node)
        delattr(gm, node.target)


def _buffer_mutations_to_outputs(gm: fx.GraphModule, n_out: int, n_after: int = 0) -> tuple[str, ...]:
    """Replace functionalization's trailing `copy_(placeholder, new)` by extra outputs, after the
    first `n_out` outputs and before the `n_after` that follow them (the inputs' gradients).

    Returns the FQNs of the mutated buffers, in the order their new values were appended.
    """
    graph = gm.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    results = list(output.args[0])
    assert len(results) == n_out + n_after
    results, after = results[:n_out], results[n_out:]
    mutated = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.copy_.default:
            continue
        dst, src = node.args[0], node.args[1]
        tag = dst.meta.get("fxzero", {}) if dst.op == "placeholder" else {}
        if tag.get("kind") != "buffer":
            what = f"{tag['kind']} {tag.get('fqn', tag.get('index'))}" if tag else dst.name
            raise ValueError(
                f"the forward mutates {what} in place; fxzero supports in-place updates of "
                "buffers only (register the state as a buffer, or make the update out of place)"
            )
        mutated.append(tag["fqn"])
        results.append(src)
        graph.erase_node(node)
    output.args = (results + after,)
    return tuple(mutated)
