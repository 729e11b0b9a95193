"""DeepSpeed's deeper names on fxzero, one process: each entry of the alias's `NAMES` table is the
fxzero object it says (`from deepspeed.runtime.engine import DeepSpeedEngine` is `fxzero.Engine`),
and the small objects behind it do what DeepSpeed's do: `load_state_dict_from_zero_checkpoint`,
`ZeroParamStatus`, `torch_info`, `deepspeed.pipe`, the CPU accelerator's device count and
current device. DeepSpeed's own test_zero.py runs on them in tests/dist/test_deepspeed_unit_tests.py."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxzero
from fxzero.accelerator import TORCH_INFO, Accelerator
from fxzero.deepspeed_alias import NAMES
from fxzero.pipe import LayerSpec, PipelineModule
from fxzero.utils import load_state_dict_from_zero_checkpoint
from fxzero.zero import ZeroParamStatus, param_status

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::fxzero.config.notices.IneffectiveSetting")]

_IMPORTS = """
from fxzero.deepspeed_alias import NAMES, install
install()
import importlib, sys, fxzero
for module, names in NAMES.items():
    for name, target in names.items():
        got = getattr(importlib.import_module("deepspeed." + module), name)
        where, _, attr = target.partition(":")
        assert got is getattr(importlib.import_module(where), attr), (module, name)
        exec(f"from deepspeed.{module} import {name} as imported")
        assert imported is got
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, GatheredParameters
assert DeepSpeedEngine is fxzero.Engine and GatheredParameters is fxzero.zero.GatheredParameters
# every way of importing reaches the same objects, attribute chains through fxzero's modules too
import deepspeed.runtime.zero.utils as zu
import deepspeed.utils.zero_to_fp32 as z2f
import deepspeed.runtime.engine as eng
import deepspeed.git_version_info
assert zu.ZeRORuntimeException is fxzero.zero.ZeRORuntimeException and eng is sys.modules["fxzero.runtime.engine"]
assert deepspeed.runtime.zero.partition_parameters.ZeroParamStatus is ZeroParamStatus
assert deepspeed.utils.zero_to_fp32 is z2f and deepspeed.git_version_info.torch_info["version"]
try:
    from deepspeed.runtime.zero.utils import is_zero_supported_optimizer
except ImportError as e:
    print("name:", e)
try:
    import deepspeed.runtime.config
except ImportError as e:
    print("module:", e)
"""


def test_every_deepspeed_name_is_the_fxzero_object_it_says():
    proc = subprocess.run([sys.executable, "-c", _IMPORTS], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert "name: cannot import name 'is_zero_supported_optimizer' from 'deepspeed.runtime.zero.utils'" in proc.stdout
    assert "deepspeed_alias.py" in proc.stdout  # (where the names it has are listed)
    assert "module: No module named 'deepspeed.runtime.config': under fxzero" in proc.stdout
    assert "deepspeed.runtime.zero.partition_parameters" in proc.stdout  # (what it has, named)


def test_deepspeeds_runtime_modules_are_attributes_after_a_plain_import():
    """`import deepspeed` alone, then `deepspeed.runtime.lr_schedules...` (accelerate's prepare reads
    VALID_LR_SCHEDULES so): DeepSpeed's import has loaded them; fxzero's gives them on access."""
    code = ("from fxzero.deepspeed_alias import install\ninstall()\nimport deepspeed, sys\n"
            "assert 'fxzero.runtime.lr_schedules' not in sys.modules\n"
            "print(deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES)\n"
            "assert deepspeed.runtime.engine.DeepSpeedEngine is deepspeed.Engine\n"
            "try:\n    deepspeed.runtime.no_such_module\nexcept AttributeError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert "'WarmupLR'" in proc.stdout and "has no attribute 'no_such_module'" in proc.stdout


@pytest.mark.parametrize("name, says", [("init_inference", "DeepSpeed-Inference"),
                                        ("DeepSpeedHybridEngine", "hybrid engine"),
                                        ("PipelineEngine", "pipeline parallelism"),
                                        ("tp_model_init", "tensor parallelism")])
def test_deepspeeds_top_level_names_for_what_fxzero_does_not_do_say_why(name, says):
    # (`deepspeed.init_inference(...)` under fxzero run: the module is fxzero)
    with pytest.raises(AttributeError, match=f"has no attribute {name!r}: .*{says}"):
        getattr(fxzero, name)
    assert not hasattr(fxzero, name)
    with pytest.raises(AttributeError, match=r"has no attribute 'no_such_name'$"):
        fxzero.no_such_name


def test_deepspeeds_top_level_names_and_its_module_helpers():
    """`from deepspeed import get_accelerator` (DeepSpeed-Chat, Megatron-DeepSpeed), and the helpers
    LoRA scripts swap layers with (`deepspeed.compression.helper`, now `deepspeed.utils.module_utils`)."""
    from fxzero.utils import recursive_getattr, recursive_setattr

    assert fxzero.get_accelerator is fxzero.accelerator.get_accelerator
    assert fxzero.log_dist is fxzero.utils.log_dist and fxzero.logger is fxzero.utils.logger
    model = nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.Tanh(), nn.Linear(3, 1)))
    assert recursive_getattr(model, "1.1") is model[1][1] and recursive_getattr(model, "0.weight") is model[0].weight
    swapped = nn.Linear(3, 1, bias=False)
    recursive_setattr(model, "1.1", swapped)
    assert model[1][1] is swapped
    recursive_setattr(model, "0", nn.Identity())
    assert isinstance(model[0], nn.Identity)
    for module in ("compression.helper", "utils.module_utils"):
        assert NAMES[module] == {"recursive_getattr": "fxzero.utils:recursive_getattr",
                                 "recursive_setattr": "fxzero.utils:recursive_setattr"}


def test_the_table_names_only_objects_that_exist():
    for names in NAMES.values():
        for target in names.values():
            where, _, attr = target.partition(":")
            assert hasattr(importlib.import_module(where), attr), target


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 3)])
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x)) * self.scale
        return x


DS = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
      "zero_optimization": {"stage": 3}}


def test_load_state_dict_from_zero_checkpoint_loads_the_trained_fp32_weights(tmp_path):
    torch.manual_seed(0)
    engine, *_ = fxzero.initialize(model=Net(), config=DS)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        engine.backward(F.cross_entropy(engine(torch.randn(4, 6, generator=g)), torch.randint(0, 3, (4,), generator=g)))
        engine.step()
    engine.save_checkpoint(str(tmp_path))
    trained = engine.full_state_dict()
    torch.manual_seed(5)
    fresh = Net()
    assert load_state_dict_from_zero_checkpoint(fresh, str(tmp_path)) is fresh
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, trained[name]), name
    assert not torch.equal(trained["layers.0.weight"], Net().layers[0].weight)  # (training moved it)
    with fxzero.zero.Init(config_dict_or_path=DS):
        placeholders = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 3))
    assert param_status(placeholders[0].weight) is ZeroParamStatus.NOT_AVAILABLE
    assert param_status(fresh.layers[0].weight) is ZeroParamStatus.AVAILABLE
    with pytest.raises(RuntimeError, match=r"\['0.weight', '0.bias', '1.weight'\] \.\.\. have no value on this rank "
                                           r"to load into .*zero.GatheredParameters"):
        load_state_dict_from_zero_checkpoint(placeholders, str(tmp_path))
    other = nn.Sequential(nn.Linear(6, 6))
    with pytest.raises(RuntimeError, match=r"does not hold this model's weights \(missing: \['0.weight', '0.bias'\], "
                                           r"unexpected: \['layers.0.weight'"):
        load_state_dict_from_zero_checkpoint(other, str(tmp_path))


def test_torch_info_the_cpu_accelerator_and_the_pipeline_refusal(monkeypatch):
    assert TORCH_INFO["version"] == ".".join(torch.__version__.split(".")[:2])
    assert TORCH_INFO["cuda_version"] == ("0.0" if torch.version.cuda is None else TORCH_INFO["cuda_version"])
    cpu = Accelerator("cpu")
    # DeepSpeed's CPU accelerator counts LOCAL_SIZE (its launcher's, and its test harness's), else torchrun's
    monkeypatch.setenv("LOCAL_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cpu.device_count() == 3
    monkeypatch.delenv("LOCAL_SIZE")
    assert cpu.device_count() == 2
    # what DeepSpeed's code passes as device= works on the CPU
    assert torch.zeros(1, device=cpu.current_device()).device.type == "cpu"
    assert isinstance(LayerSpec(nn.Linear, 4, 2, bias=False).build(), nn.Linear)
    with pytest.raises(NotImplementedError, match="fxzero has no pipeline parallelism"):
        PipelineModule(layers=[LayerSpec(nn.Linear, 4, 4)])


def test_see_memory_usage_logs_with_force_only_as_deepspeeds(caplog):
    """`deepspeed.runtime.utils.see_memory_usage`: nothing without force; with it, the message and
    the host's memory, this process's resident set included (a 64 MiB tensor held shows in it)."""
    from fxzero.utils import see_memory_usage

    held = torch.ones(16 * 1024 * 1024)  # (64 MiB, touched)
    with caplog.at_level("INFO", logger="fxzero"):
        import logging

        logging.getLogger("fxzero").propagate = True
        try:
            see_memory_usage("quiet")
            see_memory_usage("after the batch", force=True)
        finally:
            logging.getLogger("fxzero").propagate = False
    lines = [r.getMessage() for r in caplog.records]
    assert "quiet" not in lines and lines[0] == "after the batch"
    rss = float(lines[-1].split("this process: RSS ")[1].split(" GB")[0])
    assert rss >= held.numel() * 4 / 1024 ** 3 and "CPU Virtual Memory:  used = " in lines[-1]


def test_engine_compile_says_once_it_has_no_effect():
    """DeepSpeed's `engine.compile(backend=..., compile_kwargs=...)`, which accelerate calls when a
    dynamo backend is set: fxzero's programs are compiled already; it warns once, sets `is_compiled`,
    and the engine trains as before."""
    from fxzero.config.notices import IneffectiveSetting

    torch.manual_seed(0)
    engine = fxzero.compile(nn.Linear(4, 2), fxzero.Config(stage=3, optimizer=fxzero.SGD(lr=0.1), cost_model=None))
    assert not engine.is_compiled
    with pytest.warns(IneffectiveSetting, match=r"engine.compile\(backend='inductor'\) has no effect"):
        engine.compile(backend="inductor", compile_kwargs={"mode": "max-autotune"})
    assert engine.is_compiled
    loss = engine(torch.randn(3, 4)).pow(2).mean()
    engine.backward(loss)
    engine.step()
