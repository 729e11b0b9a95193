"""A data source in HF `datasets`' shape, for running DeepSpeed-Chat's training steps offline.

Only what `dschat/utils/data/raw_datasets.py` uses for its default dataset: `load_dataset(
"Dahoas/rm-static")` giving a "train" and a "test" split, each indexable with `len`, whose rows
hold `prompt`, `response`, `chosen` and `rejected` (rm-static's columns: the prompt "\n\nHuman:
... \n\nAssistant:", the responses " ..."); and `load_from_disk`, which the file imports. No
download: the words are `w4` .. `w1999` (what the tokenizer of tests/deepspeed_examples/opt_tiny.py
was trained on), prompts of 5 to 59 words and responses of 3 to 59, the same on every run and
rank: FXZERO_RM_STATIC_TRAIN rows in train (default 320), FXZERO_RM_STATIC_TEST in test (64).
"""

import os

__all__ = ["load_dataset", "load_from_disk"]


def load_from_disk(path, **kwargs):
    raise FileNotFoundError(f"this synthetic `datasets` holds no dataset on disk ({path})")


def load_dataset(path, name=None, split=None, **kwargs):
    if (path, name, split) != ("Dahoas/rm-static", None, None):
        raise ValueError(f"this synthetic `datasets` holds Dahoas/rm-static only, not {(path, name, split)}")
    import numpy as np

    rng = np.random.default_rng(3)

    def text(low, high):
        return " ".join(f"w{k}" for k in rng.integers(4, 2000, size=int(rng.integers(low, high))))

    def rows(n):
        out = []
        for _ in range(n):
            prompt, chosen, rejected = "\n\nHuman: " + text(5, 60) + "\n\nAssistant:", " " + text(3, 60), " " + text(3, 60)
            out.append({"prompt": prompt, "response": chosen, "chosen": chosen, "rejected": rejected})
        return out

    return {"train": rows(int(os.environ.get("FXZERO_RM_STATIC_TRAIN", "320"))),
            "test": rows(int(os.environ.get("FXZERO_RM_STATIC_TEST", "64")))}
