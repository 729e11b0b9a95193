"""DeepSpeed's namespace on fxzero, one process: the launcher's command line, the accelerator,
`add_config_arguments`, and the clear errors (an MoE layer, gathering before initialize, a
launcher option fxzero does not have). The multi-rank behaviour is tests/dist/test_deepspeed_namespace.py's."""

from __future__ import annotations

import argparse
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


def test_gathering_a_parameter_before_initialize_says_where_its_value_comes_from():
    with fxzero.zero.Init():
        model = nn.Linear(4, 4)
    assert model.weight.is_meta
    with pytest.raises(RuntimeError, match=r"no fxzero engine holds it yet .* Initialize it in the module's "
                                           r"reset_parameters\(\) or the model's _init_weights\(module\), or gather it "
                                           r"after fxzero.initialize"):
        with fxzero.zero.GatheredParameters(model.weight, modifier_rank=0):
            pass
    eager = nn.Linear(4, 4)
    with fxzero.zero.GatheredParameters(eager.parameters(), modifier_rank=0):  # not fxzero's: left as it is
        eager.weight.data.zero_()
    assert not eager.weight.any()


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
