"""Programs compiled for a GPU on this CPU machine ([Note: tracing for a device]).

A meta model compiled with `device="cuda"` holds the kernels a GPU runs (SDPA's flash or
memory-efficient CUDA kernels, chosen by torch's rules) and no CPU-only kernel, and every tensor
its programs create is made on `cuda`. The zoo's GPT and Llama and Hugging Face's GPT-2 and Llama,
fp32 and bf16; the CLI's `--device cuda`; the attention routing's arithmetic checked on real CPU
tensors against torch's own SDPA.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from click.testing import CliRunner

import fxzero
from fxzero.cli import main
from fxzero.target_device import _additive_bias, check_no_cpu_kernels, cpu_only_kernels, sdpa_backend
from fxzero.zoo import build

pytestmark = pytest.mark.timeout(300)

BF16 = fxzero.MixedPrecision(param_dtype=torch.bfloat16)


def _hf(name: str) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
        cls = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
        cls = transformers.LlamaForCausalLM
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return cls(config)


def _model(name: str):
    """(meta model, positional inputs, keyword inputs)."""
    if name in ("gpt-tiny", "llama-tiny"):
        with torch.device("meta"):
            model = build(name)
        return model, model.example_inputs(), {}
    ids = torch.randint(0, 256, (2, 32))
    return _hf(name), (), {"input_ids": ids, "labels": ids, "use_cache": False}


def _compile(name: str, mp, device: str):
    model, args, kwargs = _model(name)
    config = fxzero.Config(mixed_precision=mp) if mp is not None else fxzero.Config()
    return fxzero.compile_program(model, args, config, world_size=2, kwargs=kwargs, device=device)


def _nodes(compiled):
    return [n for p in compiled.programs.values() for n in p.gm.graph.nodes if n.op == "call_function"]


def _attention(compiled) -> set[str]:
    return {n.target.__name__.split(".")[0] for n in _nodes(compiled) if "scaled_dot_product" in str(n.target)}


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "gpt2", "llama"])
@pytest.mark.parametrize("mp", [None, BF16], ids=["fp32", "bf16"])
def test_a_gpu_program_holds_gpu_kernels_and_makes_its_tensors_on_cuda(name, mp):
    compiled = _compile(name, mp, "cuda")
    assert compiled.schedule.device == "cuda"
    for program in compiled.programs.values():
        assert cpu_only_kernels(program.gm) == [], program.name
    made = [n for n in _nodes(compiled) if isinstance(n.kwargs.get("device"), torch.device)]
    assert made and {n.kwargs["device"] for n in made} == {torch.device("cuda")}
    # fp32 attention runs torch's memory-efficient kernel on a GPU, bf16 without a mask its flash
    # kernel (Hugging Face's models pass a causal mask while traced: memory-efficient); forward
    # and backward both in the program
    flash = mp is not None and name in ("gpt-tiny", "llama-tiny")
    kernel = "_scaled_dot_product_flash_attention" if flash else "_scaled_dot_product_efficient_attention"
    assert _attention(compiled) == {kernel, f"{kernel}_backward"}


def test_the_same_model_for_the_cpu_keeps_the_cpu_kernels():
    compiled = _compile("gpt-tiny", None, "cpu")
    assert compiled.schedule.device == "cpu"
    assert _attention(compiled) == {"_scaled_dot_product_flash_attention_for_cpu",
                                    "_scaled_dot_product_flash_attention_for_cpu_backward"}
    assert {n.kwargs["device"].type for n in _nodes(compiled) if isinstance(n.kwargs.get("device"), torch.device)} \
        == {"cpu"}


def test_the_schedule_says_its_device_through_json():
    schedule = _compile("gpt-tiny", BF16, "cuda").schedule
    again = type(schedule).loads(schedule.dumps())
    assert again.device == "cuda" and again == schedule


def test_the_cli_compiles_a_gpu_program_without_a_gpu():
    result = CliRunner().invoke(main, ["schedule", "gpt-tiny(n_blocks=2)", "--device", "cuda", "--json"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    schedule = json.loads(result.stdout)
    assert schedule["device"] == "cuda"
    names = {i["name"] for p in schedule["programs"] for i in p["instructions"]}
    assert any(n.startswith("_scaled_dot_product_efficient_attention") for n in names)


def _qkv(dtype, head_dim=64, heads=4, kv_heads=4):
    q = torch.empty(2, heads, 16, head_dim, dtype=dtype)
    kv = torch.empty(2, kv_heads, 16, head_dim, dtype=dtype)
    return q, kv, kv


def test_the_backend_follows_torchs_rules_and_flags():
    assert sdpa_backend(*_qkv(torch.bfloat16)) == "flash"
    assert sdpa_backend(*_qkv(torch.float16, head_dim=256)) == "flash"
    assert sdpa_backend(*_qkv(torch.bfloat16, head_dim=264)) == "efficient"  # flash stops at 256
    assert sdpa_backend(*_qkv(torch.float32)) == "efficient"  # flash is fp16/bf16 only
    assert sdpa_backend(*_qkv(torch.bfloat16), attn_mask=torch.ones(16, 16, dtype=torch.bool)) == "efficient"
    assert sdpa_backend(*_qkv(torch.bfloat16, head_dim=12)) == "math"  # rows not 16-byte aligned
    assert sdpa_backend(*_qkv(torch.float32, head_dim=12)) == "efficient"  # 12 fp32 = 48 bytes
    q, k, _ = _qkv(torch.bfloat16)
    assert sdpa_backend(q, k, k.float()) == "math"  # mixed dtypes: torch's own error
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        assert sdpa_backend(*_qkv(torch.bfloat16)) == "efficient"
    with sdpa_kernel([SDPBackend.MATH]):
        assert sdpa_backend(*_qkv(torch.bfloat16)) == "math"


@pytest.mark.parametrize("mask", ["bool", "float"])
def test_a_mask_becomes_the_bias_the_efficient_kernel_takes(mask):
    """The bias the program hands the memory-efficient kernel computes SDPA's attention: checked
    with torch's math kernel on real CPU tensors against F.scaled_dot_product_attention."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 8) for _ in range(3))
    keep = torch.rand(2, 1, 7, 7) > 0.3
    keep[..., 0] = True  # (every row attends somewhere)
    given = keep if mask == "bool" else torch.where(keep, 0.0, -1e4) + torch.randn(2, 1, 7, 7)
    bias = _additive_bias(given, q, k)
    assert bias.shape == (2, 3, 7, 7) and bias.dtype == q.dtype
    assert bias.stride(-2) % 16 == 0  # rows aligned for the kernel (padded to 16, sliced back)
    ours = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, bias)[0]
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=given), rtol=0, atol=1e-6)


def test_a_cpu_only_kernel_in_a_gpu_program_is_an_error_naming_it():
    graph = fx.Graph()
    q = graph.placeholder("q")
    out = graph.call_function(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q))
    graph.output(out)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    check_no_cpu_kernels(gm, "cpu")  # (a CPU program may)
    with pytest.raises(ValueError, match=r"only the CPU runs: aten\._scaled_dot_product_flash_attention_for_cpu"):
        check_no_cpu_kernels(gm, "cuda")


def test_only_cpu_and_cuda_programs():
    with pytest.raises(ValueError, match="'cpu', 'cuda' or 'meta', not 'mps'"):
        _compile("gpt-tiny", None, "mps")


def test_attention_is_priced_alike_on_the_cpu_and_the_gpu():
    """Issue 26: the CPU program's attention had no FLOP formula and was priced at 0. Now its
    forward is 4 b h s^2 d (two matmuls of s x s x d per head), as torch prices the CUDA kernels,
    and its backward what torch's formula gives the same shapes on a GPU."""
    def attention(device):
        compiled = _compile("gpt-tiny", None, device)
        return [(p.name, i.flops) for p in compiled.schedule.programs for i in p.instructions
                if "scaled_dot_product" in i.name and "getitem" not in i.name]

    cpu, cuda = attention("cpu"), attention("cuda")
    cfg = build("gpt-tiny").config
    batch, seq = build("gpt-tiny").example_inputs()[0].shape
    forward = 4 * batch * cfg.n_heads * seq * seq * (cfg.d_model // cfg.n_heads)
    assert [f for name, f in cpu if name == "forward"] == [forward] * cfg.n_blocks
    assert [f for _, f in cpu] == [f for _, f in cuda] and all(f > 0 for _, f in cpu)
