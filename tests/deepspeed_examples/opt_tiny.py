"""A pretrained-model directory in facebook/opt-125m's shape, made offline: DeepSpeed-Chat loads its
model and tokenizer with `from_pretrained(--model_name_or_path)`, so given this one it never
downloads.

The tokenizer is OPT's kind, a GPT-2 byte-level BPE (`GPT2Tokenizer`, with the vocab.json and
merges.txt DeepSpeed-Chat's `save_hf_format` copies out), trained here on the words `w4` ..
`w1999` of the synthetic rm-static (shims/dschat/datasets), with OPT's special tokens (<s> 0,
<pad> 1, </s> 2, <unk> 3; </s> is its bos and eos). The model is an `OPTForCausalLM` of width 64,
2 layers of 4 heads, its vocabulary the tokenizer's rounded up to 8 (as DeepSpeed-Chat resizes
it), initialised from seed 0.
"""

from __future__ import annotations

import os
import shutil


def make_opt_tiny(directory: str) -> str:
    """Write the model and tokenizer into `directory` (once) and return it."""
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
    config = OPTConfig(vocab_size=8 * ((len(tokenizer) + 7) // 8), hidden_size=64, word_embed_proj_dim=64,
                       num_hidden_layers=2, ffn_dim=256, num_attention_heads=4, max_position_embeddings=256,
                       pad_token_id=1, bos_token_id=2, eos_token_id=2)
    OPTForCausalLM(config).save_pretrained(staging)
    try:
        os.rename(staging, directory)
    except OSError:  # another process made it first
        shutil.rmtree(staging, ignore_errors=True)
    return directory
