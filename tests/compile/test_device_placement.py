"""Every buffer a step allocates is on the rank's device, and a step reads the device once.

Run on a stand-in accelerator whose tensors hold no values, the meta device ([Note: buffer
kinds] in `fxzero/runtime/device.py`): `fxzero.compile(device="meta")` takes it as the rank's device, traces the
program for it (attention's accelerator kernels, `fxzero/target_device.py`), materializes the
model's states there, and trains. Then:

- a buffer left in host memory is found: a dispatch mode records the device of every tensor an
  operator makes during a step, and none may be a CPU one (a planted CPU buffer pool is caught);
- a host sync is found: reading a meta tensor's value raises, so a step that finishes read no
  device value, but in `read_step_numbers`, the one read per optimizer step ([Note: no host sync
  in a step] in `fxzero/runtime/stepping.py`), which the test counts and answers (finite, norm 1).

World of one (collectives are local copies there). Offload is left out: a tier's write copies a
device value to the host, which the meta device cannot give.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fxzero
import fxzero.runtime.stepping as stepping
from fxzero.runtime.storage.pool import BufferPool
from fxzero.zoo import build

pytestmark = pytest.mark.timeout(300)

META = torch.device("meta")
PRECISIONS = {"fp32": None, "bf16": fxzero.MixedPrecision(param_dtype=torch.bfloat16),
              "fp16": fxzero.MixedPrecision(param_dtype=torch.float16)}


class HostAllocations(TorchDispatchMode):
    """Records every operator that returns a CPU tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.device.type == "cpu":
                self.found.append(f"{func} -> {tuple(o.shape)}")
        return out


@pytest.fixture
def meta_rank(monkeypatch):
    """Counts (and answers) the step's host reads; returns their list."""
    reads: list[int] = []

    def read(bad, squares):
        assert bad is None or bad.device == META
        assert squares is None or squares.device == META
        reads.append(1)
        return 0.0, (1.0 if squares is not None else None)

    monkeypatch.setattr(stepping, "read_step_numbers", read)
    return reads


def _train(model_name: str, stage: int, precision: str, steps: int = 2):
    with torch.device("meta"):
        model = build(model_name, n_blocks=2)
    config = fxzero.Config(stage=stage, cost_model=None, mixed_precision=PRECISIONS[precision],
                           gradient_clipping=1.0)
    engine = fxzero.compile(model, config, device=META)
    x = torch.empty_like(model.example_inputs()[0], device=META)

    def step():
        loss = engine(x).float().mean()
        engine.backward(loss)
        engine.step()

    step()  # (the first compiles the program)
    host = HostAllocations()
    with host:
        for _ in range(steps):
            step()
    return engine, host.found


@pytest.mark.filterwarnings("ignore::fxzero.config.effects.SlowSetting")
@pytest.mark.parametrize("model_name,stage,precision", [
    ("gpt-tiny", 3, "fp32"), ("gpt-tiny", 3, "bf16"), ("gpt-tiny", 3, "fp16"), ("gpt-tiny", 2, "bf16"),
    ("gpt-tiny", 1, "fp32"), ("llama-tiny", 3, "bf16"),
])
def test_a_step_allocates_on_the_device_and_reads_it_once(meta_rank, model_name, stage, precision):
    engine, host = _train(model_name, stage, precision)
    assert host == []
    assert len(meta_rank) == 3  # one read per optimizer step, the compiling one included
    assert engine.device == META and engine._stepping.compiled.schedule.device == "meta"
    state = engine.state
    held = [*state.params.values(), *state.low.values(), *state.buffers.values(),
            *(t for states in state.optimizer_states.values() for t in states.values())]
    assert held and {t.device for t in held} == {META}
    kernels = {str(n.target) for p in engine._stepping.compiled.programs.values() for n in p.gm.graph.nodes}
    assert not any("_for_cpu" in k for k in kernels)


def test_a_buffer_left_in_host_memory_is_found(meta_rank, monkeypatch):
    """The check can fail: a buffer pool that hands out CPU buffers (as it did before the device
    layer) is caught, by the flat gradient copied out of a meta tensor or by the recorder."""
    take = BufferPool.take

    def on_the_host(self, numel, dtype, *, aligned=False):
        self.device = torch.device("cpu")
        return take(self, numel, dtype, aligned=aligned)

    monkeypatch.setattr(BufferPool, "take", on_the_host)
    with pytest.raises(NotImplementedError, match="meta tensor"):
        _train("gpt-tiny", 3, "fp32")


def test_a_host_read_inside_a_step_is_found(meta_rank, monkeypatch):
    """The check can fail: a flag read in the backward, as the float16 checks once were, stops the step."""
    from fxzero.runtime.executor import GradientFlags

    monkeypatch.setattr(GradientFlags, "record", lambda self, unit, grad: bool(torch.isfinite(grad).all()))
    with pytest.raises(Exception, match="meta"):
        _train("gpt-tiny", 3, "fp16")
