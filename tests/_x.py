import torch
from tests.dist.harness import run_ranks

def body(rank, world, stage, dtype):
    import fxzero, copy
    from fxzero import deepspeed_alias
    deepspeed_alias.install()
    import deepspeed
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained("/tmp/fxzero-opt-tiny")
    ref = copy.deepcopy(model)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    if dtype == "bf16": cfg["bf16"] = {"enabled": True}
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(4, 2000, (2, 16), generator=g)
    res = {}
    for step in range(2):
        eng.train()
        out = eng(input_ids=ids, labels=ids, use_cache=False)
        eng.backward(out.loss); eng.step()
        eng.eval()
        with torch.no_grad():
            direct = eng.module(input_ids=ids, use_cache=False).logits.float()
            gen = eng.module.generate(ids[:, :4], attention_mask=torch.ones(2, 4, dtype=torch.long), max_length=12, pad_token_id=1, synced_gpus=stage == 3)
        # reference: the engine's current weights gathered, in a plain module
        with deepspeed.zero.GatheredParameters(list(eng.module.parameters())):
            sd = {k: v.detach().clone() for k, v in eng.module.state_dict().items()}
        r = copy.deepcopy(ref).to(sd[next(iter(sd))].dtype)
        r.load_state_dict(sd, strict=False)
        r.eval()
        with torch.no_grad():
            want = r(input_ids=ids, use_cache=False).logits.float()
            wgen = r.generate(ids[:, :4], attention_mask=torch.ones(2, 4, dtype=torch.long), max_length=12, pad_token_id=1)
        res[step] = ((direct - want).abs().max().item(), bool((gen == wgen).all()), (sd["model.decoder.layers.0.fc1.weight"].float() - ref.state_dict()["model.decoder.layers.0.fc1.weight"]).abs().max().item())
    return res

if __name__ == "__main__":
    import sys
    for stage in (2, 3):
        print(stage, run_ranks(body, 2, stage, sys.argv[1], timeout_s=300))
