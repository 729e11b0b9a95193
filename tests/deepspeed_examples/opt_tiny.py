"""A pretrained-model directory in facebook/opt-125m's shape, made offline: DeepSpeed-Chat loads its
model and tokenizer with `from_pretrained(--model_name_or_path)`, so given this one it never
downloads.

The tokenizer is OPT's kind, a GPT-2 byte-level BPE (`GPT2Tokenizer`, with the vocab.json and
merges.txt DeepSpeed-Chat's `save_hf_format` copies out), trained here on the words `w4` ..
`w1999` of the synthetic rm-static (shims/dschat/datasets), with OPT's special tokens (<s> 0,
<pad> 1, </s> 2, <unk> 3; </s> is its bos and eos). The model is an `OPTForCausalLM` of width 64,
2 layers of 4 heads, its vocabulary the tokenizer's rounded up to 8 (as DeepSpeed-Chat resizes
it), initialised from seed 0 and stored in fp32 with values bf16 holds exactly. (DeepSpeed casts
the module to bf16 before it copies its fp32 master weights, so its masters start from the
pretrained weights rounded to bf16; fxzero's start from the pretrained values themselves. From
pretrained weights of bf16 values both start alike, and their bf16 runs differ by the rounding
of what they compute only.)
"""

from __future__ import annotations

import os
import shutil


VERSION = 2
"""Part of the directories' names (`directory_for`): a change to what is written here changes it, so a
directory written by an earlier version is never taken for this one's."""


def directory_for(kind: str, parent: str) -> str:
    """Where the `kind` ("opt" or "critic") directory of this version lives under `parent`."""
    return os.path.join(parent, f"fxzero-opt-tiny-{kind}-v{VERSION}")


def make_opt_tiny(directory: str, *, width: int = 64, layers: int = 2, heads: int = 4, positions: int = 256) -> str:
    """Write the model and tokenizer into `directory` (once) and return it (a bigger model with
    `width`, `layers`, `heads`, `positions`: OPT-125m's are 768, 12, 12, 2048, its feed-forward
    4 x width)."""
    if os.path.exists(os.path.join(directory, "model.safetensors")):
        return directory
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2TokenizerFast, OPTConfig, OPTForCausalLM

    staging = f"{directory}.tmp{os.getpid()}"  # (written aside, then renamed: processes may race to make it)
    os.makedirs(staging)
    words = [f"w{k}" for k in range(4, 2000)]
    corpus = [" ".join(words[i:i + 50]) for i in range(0, len(words), 50)] * 2 + ["\n\nHuman: \n\nAssistant:"]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=2400, min_frequency=1, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                            show_progress=False)
    bpe.save_model(staging)  # (vocab.json, merges.txt: GPT2Tokenizer's vocab_file, merges_file)
    tokenizer = GPT2TokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="</s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>")
    tokenizer.save_pretrained(staging)
    torch.manual_seed(0)
    config = OPTConfig(vocab_size=8 * ((len(tokenizer) + 7) // 8), hidden_size=width, word_embed_proj_dim=width,
                       num_hidden_layers=layers, ffn_dim=4 * width, num_attention_heads=heads,
                       max_position_embeddings=positions,
                       pad_token_id=1, bos_token_id=2, eos_token_id=2)
    model = OPTForCausalLM(config)
    with torch.no_grad():  # (values bf16 holds exactly: see the module's docstring)
        for parameter in model.parameters():
            parameter.copy_(parameter.to(torch.bfloat16))
    model.save_pretrained(staging)
    try:
        os.rename(staging, directory)
    except OSError:  # another process made it first
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def make_opt_tiny_critic(directory: str, pretrained: str) -> str:
    """A reward-model directory in the shape DeepSpeed-Chat's step 2 saves (its step 3's
    --critic_model_name_or_path): the pretrained directory's config and tokenizer, and a
    `pytorch_model.bin` holding a `RewardModel`'s state dict, the pretrained OPT decoder under
    `rwtransformer.` and a value head `v_head.weight` (1 x 64, normal of std 0.02 from seed 1).
    Written once into `directory`."""
    if os.path.exists(os.path.join(directory, "pytorch_model.bin")):
        return directory
    import torch
    from safetensors.torch import load_file

    staging = f"{directory}.tmp{os.getpid()}"
    shutil.copytree(pretrained, staging, ignore=shutil.ignore_patterns("model.safetensors"))
    state = {f"rwtransformer.{key[len('model.'):]}": value
             for key, value in load_file(os.path.join(pretrained, "model.safetensors")).items()
             if key.startswith("model.")}
    state["v_head.weight"] = torch.randn(1, 64, generator=torch.Generator().manual_seed(1)) * 0.02
    torch.save(state, os.path.join(staging, "pytorch_model.bin"))
    try:
        os.rename(staging, directory)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return directory
