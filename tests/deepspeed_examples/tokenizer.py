"""A tokenizer in roberta-base's shape, made offline: HelloDeepSpeed loads its tokenizer with
`AutoTokenizer.from_pretrained(--tokenizer)`, so given this one's directory it never downloads.

RoBERTa's special ids (<s> 0, <pad> 1, </s> 2, <unk> 3, <mask> 50264) and vocabulary size
(50265), a word-level vocabulary `w4` .. `w50263` that the synthetic wikitext of
shims/datasets maps one word to one id.
"""

from __future__ import annotations

import os
import shutil

VOCAB = 50265


def make_tokenizer(directory: str) -> str:
    """Write the tokenizer into `directory` (once) and return it."""
    if os.path.exists(os.path.join(directory, "tokenizer.json")):
        return directory
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "<mask>": VOCAB - 1}
    vocab.update({f"w{k}": k for k in range(4, VOCAB - 1)})
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", mask_token="<mask>")
    staging = f"{directory}.tmp{os.getpid()}"  # (written aside, then renamed: processes may race to make it)
    fast.save_pretrained(staging)
    try:
        os.rename(staging, directory)
    except OSError:  # another process made it first
        shutil.rmtree(staging, ignore_errors=True)
    return directory
