"""fxzero on one GPU, checked against eager PyTorch and FSDP2: one script, one JSON.

    python tools/gpu_check.py > gpu_check.json          # on a CUDA machine (one GPU), < 8 minutes
    python tools/gpu_check.py --dry-run                 # here: the same flow on the meta device

What it measures, per model (the zoo GPT at GPT-2 size in fp32 and bf16, an HF Llama from its
config in bf16), fxzero's world of one against eager PyTorch on the same GPU and the same data:

- `parity`: the losses of 5 steps, fxzero's and eager's (same init, same AdamW), and the largest
  relative difference (the issue's bars: 1e-5 fp32, 1e-2 bf16, where eager bf16 is autocast);
- `step_s`: median step time of fxzero, eager and FSDP2 (`fully_shard`, world of one, bf16 with a
  MixedPrecisionPolicy where fxzero runs bf16), and fxzero's ratio to eager (bar: 1.1);
- `memory`: torch.cuda.max_memory_allocated() of fxzero's step against fxzero's own prediction
  (model states + the peak over the step of gathered buffers, activations and gradients, from
  the compiled program's memory record; bar: within 10%);
- `host_syncs`: synchronizations torch reports (`set_sync_debug_mode("warn")`) in the forward and
  backward, and in the step (fxzero reads the device once per optimizer step: [Note: no host sync
  in a step] in `fxzero/runtime/stepping.py`);
- `offload`: cpu and nvme tiers (parameters and optimizer states), the step time and, from the
  profiler, the share of host<->device copy time that overlaps compute kernels (bar: 0.8);
- `sanitizer`: one step under TORCH_CUDA_SANITIZER=1 (a child process), its verdict;
- `checkpoint`: saved from the GPU, loaded by a CPU process (CUDA hidden), parameters equal;
- `activations`: an HF GPT-2 with its dropouts under each activation policy (resident, unit,
  selective, the cpu tier, a memory budget between resident and unit): losses of 5 steps equal
  the resident run's bit for bit (the CUDA generator's dropout masks replayed in the backward:
  [Note: replaying random operators] in `fxzero/ir/rng.py`), the activations held after a
  forward (and as counted from the program), max_memory_allocated and the median step.

Each section reports {"error": ...} instead of stopping the others. `--dry-run` runs the flow on
the meta device (tensors without values, `fxzero.compile(device="meta")`): every program traced
for an accelerator, every buffer on it; times, memory, the profiler, the sanitizer and the
checkpoint need a GPU and are reported as skipped. Needs: torch (2.11 to 2.13), transformers;
fxzero from this checkout (run from the repository root).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxzero  # noqa: E402
from fxzero.zoo import build  # noqa: E402

STEPS, WARMUP, PARITY_STEPS, LR = 10, 3, 5, 1e-3


# -- models and data ---------------------------------------------------------------------------

def _model(name: str, dry: bool):
    """A fresh model (on the current default device) and a loss of (model, batch)."""
    if name.startswith("gpt"):
        model = build("gpt-tiny" if dry else "gpt2")
        return model, lambda m, ids: F.cross_entropy(m(ids[:, :-1]).float().flatten(0, 1), ids[:, 1:].flatten())
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=2 if dry else 8, hidden_size=64 if dry else 1024,
                                      intermediate_size=128 if dry else 2816, num_attention_heads=4 if dry else 16,
                                      num_key_value_heads=2 if dry else 8, vocab_size=256 if dry else 32000)
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config)
    return model, lambda m, ids: m(input_ids=ids, labels=ids, use_cache=False).loss.float()


def _batches(name: str, dry: bool, device, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    vocab, seq, batch = (96, 17, 2) if dry and name.startswith("gpt") else (256, 32, 2) if dry else \
        (50257, 257, 8) if name.startswith("gpt") else (32000, 512, 8)
    return [torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(n)]


def _seeded(name: str, dry: bool, device):
    """The model as eager construction after torch.manual_seed(0) makes it, on `device`."""
    torch.manual_seed(0)
    model, loss = _model(name, dry)
    return model.to(device), loss


def _time(step, device, n: int) -> list[float]:
    times = []
    for _ in range(n):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


# -- fxzero, eager and FSDP2 -------------------------------------------------------------------

def _engine(name: str, bf16: bool, dry: bool, device, offload=None):
    with torch.device("meta"):
        model, loss = _model(name, dry)
    mp = fxzero.MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
    config = fxzero.Config(stage=3, seed=0, cost_model=None, mixed_precision=mp, gradient_clipping=None,
                           optimizer=fxzero.AdamW(lr=LR, weight_decay=0.0), offload=offload or fxzero.Offload())
    return fxzero.compile(model, config, device=device), loss


def _fxzero_step(engine, loss_fn, ids):
    loss = loss_fn(engine, ids)
    engine.backward(loss)
    engine.step()
    return loss.detach()


def _eager_step(model, optimizer, loss_fn, ids, bf16: bool):
    with torch.autocast(ids.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
        loss = loss_fn(model, ids)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _losses(values: list[torch.Tensor]) -> list[float]:
    return [float(v) for v in values]


def parity_and_speed(name: str, bf16: bool, dry: bool, device) -> dict:
    batches = _batches(name, dry, device, PARITY_STEPS + WARMUP + STEPS)
    engine, loss_fn = _engine(name, bf16, dry, device)
    ours = [_fxzero_step(engine, loss_fn, ids) for ids in batches[:PARITY_STEPS]]
    out: dict = {"host_syncs": _host_syncs(engine, loss_fn, batches[0], dry)}
    if dry:  # (eager on the meta device stops where a model reads a value, as HF's masks do)
        out.update(losses="skipped (dry run)", step_s="skipped (dry run)", fxzero_steps=len(ours) + 1)
        return out
    # fxzero's time and peak memory first, with nothing else of this model on the GPU
    timed = batches[PARITY_STEPS:]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fx_times = _time(lambda it=iter(timed): _fxzero_step(engine, loss_fn, next(it)), device, len(timed))[WARMUP:]
    out["memory"] = {"max_memory_allocated": torch.cuda.max_memory_allocated(), "predicted": _predicted_peak(engine)}
    out["memory"]["ratio"] = out["memory"]["max_memory_allocated"] / out["memory"]["predicted"]
    engine.close()
    del engine
    torch.cuda.empty_cache()
    model, _ = _seeded(name, dry, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    theirs = [_eager_step(model, optimizer, loss_fn, ids, bf16) for ids in batches[:PARITY_STEPS]]
    out["losses"] = {"fxzero": _losses(ours), "eager": _losses(theirs)}
    out["max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(out["losses"]["fxzero"], out["losses"]["eager"]))
    out["bar"] = 1e-2 if bf16 else 1e-5
    eager_times = _time(lambda it=iter(timed): _eager_step(model, optimizer, loss_fn, next(it), bf16), device,
                        len(timed))[WARMUP:]
    out["step_s"] = {"fxzero": statistics.median(fx_times), "eager": statistics.median(eager_times)}
    out["step_s"]["fxzero_over_eager"] = out["step_s"]["fxzero"] / out["step_s"]["eager"]
    del model, optimizer
    torch.cuda.empty_cache()
    out["step_s"]["fsdp2"] = _fsdp2_step(name, bf16, timed, device)
    return out


def _fsdp2_step(name: str, bf16: bool, batches, device):
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError as e:
        return {"error": f"no FSDP2 in this torch: {e}"}
    model, loss_fn = _seeded(name, False, device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs = {"mp_policy": policy} if policy is not None else {}
    for module in model.modules():
        if type(module).__name__ in ("Block", "LlamaDecoderLayer"):  # (fxzero's units: the blocks, then the rest)
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    times = _time(lambda it=iter(batches): _eager_step(model, optimizer, loss_fn, next(it), False), device,
                  len(batches))[WARMUP:]
    return statistics.median(times)


def _host_syncs(engine, loss_fn, ids, dry: bool) -> dict:
    """Synchronizations torch reports in one step: in the forward and backward, and in the step."""
    if dry:  # (on the meta device a read of a value raises: the step ran, so none but the step's)
        return {"forward_backward": 0, "step": 1, "how": "dry run: a host read of a meta tensor raises"}
    counts = {}
    for phase in ("forward_backward", "step"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                if phase == "forward_backward":
                    loss = loss_fn(engine, ids)
                    engine.backward(loss)
                else:
                    engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts[phase] = sum("synchroniz" in str(w.message) for w in caught)
    return counts


def _predicted_peak(engine) -> int:
    """fxzero's prediction of the step's peak device memory (fxzero.artifacts.predicted_peak_bytes)."""
    from fxzero.artifacts import predicted_peak_bytes

    return predicted_peak_bytes(engine._stepping.compiled, engine.config)


# -- offload, sanitizer, checkpoint ------------------------------------------------------------

def offload(tier: str, dry: bool, device) -> dict:
    if dry:
        return {"skipped": "dry run: a tier's write reads a device value"}
    with tempfile.TemporaryDirectory() as tmp:
        place = fxzero.Cpu() if tier == "cpu" else fxzero.Nvme(path=tmp)
        engine, loss_fn = _engine("gpt", True, False, device, fxzero.Offload(params=place, optimizer=place))
        batches = _batches("gpt", False, device, WARMUP + 3)
        for ids in batches[:WARMUP]:
            _fxzero_step(engine, loss_fn, ids)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            times = _time(lambda it=iter(batches[WARMUP:]): _fxzero_step(engine, loss_fn, next(it)), device, 3)
        engine.close()
    return {"step_s": statistics.median(times), "copy_overlap": _copy_overlap(prof)}


def _copy_overlap(prof) -> dict:
    """The share of host<->device copy time during which a compute kernel also runs."""
    copies, kernels = [], []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (e.time_range.start, e.time_range.end)
        (copies if "memcpy" in e.name.lower() else kernels).append(span)
    total = sum(b - a for a, b in copies)
    overlapped = 0
    for a, b in copies:
        covered = sorted((max(a, c), min(b, d)) for c, d in kernels if c < b and d > a)
        end = a
        for s, t in covered:
            s = max(s, end)
            if t > s:
                overlapped += t - s
                end = t
    return {"copy_us": total, "overlapped_us": overlapped, "share": overlapped / total if total else None}


def sanitizer(dry: bool) -> dict:
    if dry:
        return {"skipped": "dry run: needs CUDA"}
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    proc = subprocess.run([sys.executable, __file__, "--one-step"], env=env, capture_output=True, text=True,
                          timeout=240)
    text = proc.stdout + proc.stderr
    return {"rc": proc.returncode, "race_reported": "CSAN" in text or "data race" in text.lower(),
            "tail": text[-1500:] if proc.returncode else ""}


def one_step() -> None:
    device = torch.device("cuda")
    engine, loss_fn = _engine("gpt", True, False, device)
    for ids in _batches("gpt", False, device, 2):
        _fxzero_step(engine, loss_fn, ids)
    torch.cuda.synchronize()
    print("one step: ok")


def checkpoint(dry: bool, device) -> dict:
    if dry:
        return {"skipped": "dry run: needs values"}
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return {"skipped": "xxhash is not installed here: fxzero's checkpoints carry XXH3 checksums"}
    with tempfile.TemporaryDirectory() as tmp:
        engine, loss_fn = _engine("gpt", True, False, device)
        for ids in _batches("gpt", False, device, 2):
            _fxzero_step(engine, loss_fn, ids)
        engine.save_checkpoint(os.path.join(tmp, "ckpt"), tag="gpu")
        torch.save({k: v.cpu() for k, v in engine.full_state_dict().items()}, os.path.join(tmp, "expected.pt"))
        engine.close()
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        proc = subprocess.run([sys.executable, __file__, "--load-on-cpu", tmp], env=env, capture_output=True,
                              text=True, timeout=240)
    return {"rc": proc.returncode, "result": proc.stdout.strip()[-500:],
            "tail": proc.stderr[-1500:] if proc.returncode else ""}


def load_on_cpu(directory: str) -> None:
    engine, _ = _engine("gpt", True, False, torch.device("cpu"))
    engine.load_checkpoint(os.path.join(directory, "ckpt"), tag="gpu")
    expected = torch.load(os.path.join(directory, "expected.pt"), weights_only=True)
    got = engine.full_state_dict()
    equal = all(torch.equal(got[k], expected[k]) for k in expected)
    print(json.dumps({"equal": equal, "tensors": len(expected)}))


# -- main --------------------------------------------------------------------------------------

# -- activations -------------------------------------------------------------------------------

ACTIVATION_POLICIES = ("none", "unit", "selective", "cpu", "budget")


def _activations_config(policy: str, budget: int) -> "fxzero.Activations":
    if policy == "cpu":
        return fxzero.Activations(offload=fxzero.Cpu(), offload_min_bytes=0)
    if policy == "budget":
        return fxzero.Activations(memory_budget=budget, offload=fxzero.Cpu(), offload_min_bytes=0)
    return fxzero.Activations(recompute=policy)


def _gpt2(dry: bool):
    import transformers

    config = transformers.GPT2Config(n_layer=2 if dry else 6, n_embd=64 if dry else 512, n_head=4 if dry else 8,
                                     vocab_size=256 if dry else 8192, n_positions=64 if dry else 1024)
    return transformers.GPT2LMHeadModel(config)


def activations(dry: bool, device) -> dict:
    vocab, seq, batch = (256, 32, 2) if dry else (8192, 1024, 4)
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(PARITY_STEPS)]
    out: dict = {}
    for policy in ACTIVATION_POLICIES:
        budget = (out["none"]["counted"] + out["unit"]["counted"]) // 2 if policy == "budget" else 0
        with torch.device("meta"):
            model = _gpt2(dry)
        config = fxzero.Config(stage=3, seed=0, cost_model="h100x8-nvlink", gradient_clipping=None,
                               optimizer=fxzero.AdamW(lr=LR, weight_decay=0.0),
                               activations=_activations_config(policy, budget))
        engine = fxzero.compile(model, config, device=device)
        torch.manual_seed(5)  # (the dropout masks: the same draws under every policy)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        losses, times, held = [], [], 0
        for ids in batches:
            start = time.perf_counter()
            result = engine(input_ids=ids, labels=ids, use_cache=False)
            held = max(held, engine.memory_report()["activations"])
            engine.backward(result.loss)
            engine.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            losses.append(result.loss.detach())
        from fxzero.activation_estimate import count_saved

        counted = count_saved(engine._stepping.compiled, policy).total  # (from the program: a meta tensor holds no bytes)
        out[policy] = {"held": None if dry else held, "counted": counted, "budget": budget or None,
                       "max_memory_allocated": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
                       "step_s": None if dry else statistics.median(times[1:]),
                       "losses": None if dry else _losses(losses)}
        engine.close()
        del engine, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not dry:
        out["losses_equal"] = {p: out[p]["losses"] == out["none"]["losses"] for p in ACTIVATION_POLICIES}
        out["within_budget"] = out["budget"]["held"] <= out["budget"]["budget"]
        out["held_equals_counted"] = {p: out[p]["held"] == out[p]["counted"] for p in ACTIVATION_POLICIES}
    return out


def _section(fn, *args) -> dict:
    start = time.perf_counter()
    try:
        out = fn(*args)
    except Exception as e:  # one section's failure is reported, the others still run
        out = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the same flow on the meta device (no GPU needed)")
    parser.add_argument("--one-step", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--load-on-cpu", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_step:
        return one_step()
    if args.load_on_cpu:
        return load_on_cpu(args.load_on_cpu)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on a GPU machine, or with --dry-run")
    device = torch.device("meta") if dry else torch.device("cuda", 0)
    if dry:  # the step's one read of the device, answered (a meta tensor has no value to read)
        import fxzero.runtime.stepping as stepping

        stepping.read_step_numbers = lambda bad, squares: (0.0, 1.0 if squares is not None else None)
    else:
        torch.cuda.set_device(0)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        torch.distributed.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)  # (FSDP2 needs one)
    started = time.perf_counter()
    report: dict = {
        "torch": torch.__version__, "python": sys.version.split()[0], "dry_run": dry,
        "device": "meta (dry run)" if dry else torch.cuda.get_device_name(0),
        "models": {label: _section(parity_and_speed, name, bf16, dry, device) for label, name, bf16 in (
            ("zoo-gpt-fp32", "gpt", False), ("zoo-gpt-bf16", "gpt", True), ("hf-llama-bf16", "llama", True))},
        "offload": {tier: _section(offload, tier, dry, device) for tier in ("cpu", "nvme")},
        "sanitizer": _section(sanitizer, dry),
        "checkpoint": _section(checkpoint, dry, device),
        "activations": _section(activations, dry, device),
    }
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
