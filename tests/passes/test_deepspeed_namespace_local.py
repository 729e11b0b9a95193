"""DeepSpeed's namespace on fxzero, one process: the launcher's command line, the accelerator,
`add_config_arguments`, and the clear errors (an MoE layer, gathering before initialize, a
launcher option fxzero does not have). The multi-rank behaviour is tests/dist/test_deepspeed_namespace.py's."""

from __future__ import annotations

import argparse
import json
import os
import sys

import click
import pytest
import torch
import torch.nn as nn

import fxzero
from fxzero.accelerator import get_accelerator
from fxzero.cli.run_cmd import SHIM, launch_command

pytestmark = pytest.mark.timeout(60)


def test_deepspeed_launcher_options_become_torchruns():
    cmd, env = launch_command(["--num_gpus", "2", "--master_port=1234", "train.py", "--deepspeed_config", "c.json"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc_per_node=2" in cmd and "--master_port=1234" in cmd
    # the worker, then the script with its own arguments untouched (run_worker adds --local_rank)
    i = cmd.index("fxzero.cli.run_worker")
    assert cmd[i + 1:] == ["train.py", "--deepspeed_config", "c.json"]
    assert env["PYTHONPATH"].split(os.pathsep)[0] == SHIM
    assert os.path.isfile(os.path.join(SHIM, "deepspeed", "__init__.py"))
    cmd, _ = launch_command(["--num_nodes=2", "--node_rank", "1", "--master_addr", "10.0.0.1", "--no_local_rank",
                             "--standalone", "-m", "pkg.train", "--x", "1"])
    assert {"--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.1", "--standalone"} <= set(cmd)
    i = cmd.index("fxzero.cli.run_worker")
    assert cmd[i + 1:] == ["--no_local_rank", "--module", "pkg.train", "--x", "1"]


@pytest.mark.parametrize("option", ["--hostfile=hosts", "--include=localhost:0", "--launcher=slurm"])
def test_ssh_launching_is_refused_with_the_torchrun_way(option):
    with pytest.raises(click.UsageError, match=r"launches the processes of this node through torchrun; for several "
                                                r"nodes, run `fxzero run --num_nodes N --node_rank R"):
        launch_command([option, "train.py"])


def test_add_config_arguments_is_deepspeeds():
    parser = fxzero.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed and args.deepspeed_config == "ds.json" and not args.deepscale and args.deepscale_config is None


def test_the_cpu_accelerator_answers_as_deepspeeds():
    acc = get_accelerator()
    assert acc.device_name() == "cpu" and acc.device_name(1) == "cpu" and acc.communication_backend_name() == "gloo"
    assert acc.is_available() and acc.is_bf16_supported() and not acc.is_fp16_supported()
    assert acc.on_accelerator(torch.zeros(1)) and acc.memory_allocated() == 0
    stream = acc.Stream()
    with acc.stream(stream):  # (CPU streams are torch's no-ops)
        acc.synchronize()
    with pytest.raises(NotImplementedError, match="no DeepSpeed op builders"):
        acc.create_op_builder("CPUAdamBuilder")


def test_an_expert_layer_is_refused():
    with pytest.raises(NotImplementedError, match="fxzero has no mixture of experts"):
        fxzero.moe.layer.MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2)
    params = {"params": list(nn.Linear(2, 2).parameters()), "name": "parameters"}
    assert fxzero.moe.utils.split_params_into_different_moe_groups_for_optimizer(params) == [params]


def test_gathering_before_initialize_builds_the_model_whole_from_its_own_init():
    """[Note: gathering before initialize] in fxzero/zero.py: what Hugging Face's from_pretrained does
    at ZeRO-3 (init, then the checkpoint's values written on rank 0, module by module)."""
    torch.manual_seed(3)
    eager = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    torch.manual_seed(3)
    with fxzero.zero.Init():
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    after_block = torch.rand(1)
    weight = model[0].weight
    weight._is_hf_initialized = True  # (a flag set before the gather stays on the parameter)
    assert weight.is_meta
    with torch.no_grad(), fxzero.zero.GatheredParameters(weight, modifier_rank=None):
        assert torch.equal(weight, eager[0].weight)  # the values its own init gives, as eager construction
        weight.zero_()  # dropped: no modifier
    assert model[0].weight is weight and weight._is_hf_initialized and not weight.is_meta
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), eager.state_dict().values()))
    with torch.no_grad(), fxzero.zero.GatheredParameters(list(model[2].parameters()), modifier_rank=0):
        model[2].weight.fill_(0.5)  # kept: the modifier's
    assert torch.equal(model[2].weight, torch.full((2, 4), 0.5))
    torch.manual_seed(3)
    nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    assert torch.equal(torch.rand(1), after_block)  # the block left the RNG where eager construction does
    engine = fxzero.compile(model, fxzero.Config(stage=3))  # sharded from the values it holds now
    full = engine.full_state_dict()
    assert torch.equal(full["2.weight"], torch.full((2, 4), 0.5)) and torch.equal(full["0.weight"], eager[0].weight)

    with pytest.raises(RuntimeError, match=r"GatheredParameters inside a zero.Init block: .* Set the values in the "
                                           r"module's reset_parameters\(\)"):
        with fxzero.zero.Init():
            inner = nn.Linear(4, 4)
            with fxzero.zero.GatheredParameters(inner.weight, modifier_rank=0):  # (DeepSpeed's tests do, in __init__)
                pass
    with torch.device("meta"):
        bare = nn.Linear(4, 4)  # on the meta device without zero.Init: nothing gives it values
    with pytest.raises(RuntimeError, match=r"this parameter is on the meta device, no fxzero engine holds it and it "
                                           r"was not built under fxzero.zero.Init, so it has no values to gather"):
        with fxzero.zero.GatheredParameters(bare.weight, modifier_rank=0):
            pass
    eager = nn.Linear(4, 4)
    with fxzero.zero.GatheredParameters(eager.parameters(), modifier_rank=0):  # not fxzero's: left as it is
        eager.weight.data.zero_()
    assert not eager.weight.any()


def test_huggingface_patches_of_zero_init_find_deepspeeds_names():
    """transformers' prevent_arange_dtype_change swaps partition_parameters'
    zero_wrapper_for_fp_tensor_constructor around zero.Init: fxzero's Init casts nothing, so the
    name is there and is the identity."""
    from fxzero.deepspeed_alias import install

    install()
    from deepspeed.runtime.zero import partition_parameters as pp

    assert pp.zero_wrapper_for_fp_tensor_constructor(torch.arange, torch.float16, "cpu") is torch.arange


def test_zero_init_inside_transformers_no_init_weights_draws_what_eager_construction_draws():
    """from_pretrained at ZeRO-3 builds the model in transformers' no_init_weights() and then
    zero.Init: torch.nn.init's functions and post_init()'s init do nothing there, so eager
    construction draws nothing, and zero.Init must leave the RNG where it was (it moved it by a
    whole init's draws, and every dropout mask after differed from DeepSpeed's)."""
    transformers = pytest.importorskip("transformers")
    from transformers.initialization import no_init_weights

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(1)
    with no_init_weights():
        transformers.LlamaForCausalLM(config)
    eager = torch.random.get_rng_state()
    torch.manual_seed(1)
    with no_init_weights(), fxzero.zero.Init():
        model = transformers.LlamaForCausalLM(config)
    assert torch.equal(torch.random.get_rng_state(), eager)
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(config)  # (without it, construction draws the model's init)
    drawn = torch.random.get_rng_state()
    torch.manual_seed(1)
    with fxzero.zero.Init():
        transformers.LlamaForCausalLM(config)
    assert torch.equal(torch.random.get_rng_state(), drawn) and not torch.equal(drawn, eager)
    assert all(p.is_meta and p.ds_status is fxzero.zero.ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())


def test_zero_init_disabled_builds_eagerly_and_unknown_options_are_named():
    with fxzero.zero.Init(enabled=False):
        model = nn.Linear(4, 4)
    assert not model.weight.is_meta
    with pytest.raises(ValueError, match=r"remote_device='gpu'\): one of None, 'cpu', 'nvme'"):
        fxzero.zero.Init(remote_device="gpu")


def test_stage_0_is_reported_as_deepspeed_names_it():
    model = nn.Linear(4, 4)
    engine, *_ = fxzero.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                        "optimizer": {"type": "Adam"}})
    assert engine.zero_optimization_stage() == 0 and engine.config.stage == 1  # (run as ZeRO-1: the same update)
    engine, *_ = fxzero.initialize(model=nn.Linear(4, 4), config={"train_micro_batch_size_per_gpu": 1,
                                                                  "zero_optimization": {"stage": 2}})
    assert engine.zero_optimization_stage() == 2


def test_the_shim_is_an_installed_deepspeed_to_accelerate_and_transformers():
    """accelerate and transformers take DeepSpeed as installed only with its package metadata
    (`importlib.metadata`): under `fxzero run` that is fxzero's, giving the DeepSpeed version whose
    API it follows. With it, the names Hugging Face's Trainer imports resolve to fxzero's."""
    import subprocess

    from fxzero.config.deepspeed_defaults import DEEPSPEED_VERSION
    from fxzero.config.schedules import SCHEDULES

    code = ("import importlib.metadata, json, deepspeed\n"
            "from accelerate.utils import is_deepspeed_available as a\n"
            "from transformers.integrations.deepspeed import is_deepspeed_available as t\n"
            "from deepspeed import DeepSpeedEngine\n"
            "from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES\n"
            "print(json.dumps([importlib.metadata.version('deepspeed'), a(), t(), DeepSpeedEngine.__module__,"
            " VALID_LR_SCHEDULES]))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SHIM, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    version, by_accelerate, by_transformers, engine_module, schedules = json.loads(out.stdout.strip().splitlines()[-1])
    assert version == f"{DEEPSPEED_VERSION}+fxzero" and by_accelerate and by_transformers
    assert engine_module == "fxzero.runtime.engine" and sorted(schedules) == sorted(SCHEDULES)
