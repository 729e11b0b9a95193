"""A data source in HF `datasets`' shape, for running DeepSpeedExamples' HelloDeepSpeed offline.

Only what `training/HelloDeepSpeed/train_bert_ds.py` uses: `load_dataset("wikitext",
"wikitext-2-v1", split="train")` with `.filter`, `.map`, `len` and indexing, and the
`datasets.arrow_dataset.Dataset` type its annotations name. No download: the lines are synthetic
text of wikitext-2's shape (about a third of the lines empty, the others 1 to 400 words, a few
long), words `w<k>` that the synthetic tokenizer of tests/deepspeed_examples/tokenizer.py maps
to one id each; `FXZERO_WIKITEXT_LINES` lines (default 2000), the same on every run and rank.
With `FXZERO_WIKITEXT_WORDS=n` every line has n words instead (no empty ones): with n at least
the script's max_seq_length every batch has one padded length, the fixed-padding comparison run.
"""

import os

from . import arrow_dataset
from .arrow_dataset import Dataset

__all__ = ["Dataset", "arrow_dataset", "load_dataset"]


def load_dataset(path, name=None, split=None, **kwargs):
    if (path, name, split) != ("wikitext", "wikitext-2-v1", "train"):
        raise ValueError(f"this synthetic `datasets` holds wikitext-2-v1's train split only, not {(path, name, split)}")
    import numpy as np

    rng = np.random.default_rng(2)
    fixed = int(os.environ.get("FXZERO_WIKITEXT_WORDS", "0"))
    lines = []
    for _ in range(int(os.environ.get("FXZERO_WIKITEXT_LINES", "2000"))):
        if not fixed and rng.random() < 0.35:
            lines.append({"text": ""})
            continue
        n = fixed or int(min(400, rng.lognormal(mean=3.8, sigma=0.9)) + 1)
        words = rng.integers(4, 50264, size=n)
        lines.append({"text": " " + " ".join(f"w{k}" for k in words) + " \n"})
    return Dataset(lines)
