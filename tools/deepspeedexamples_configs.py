"""Copy every DeepSpeed config JSON file of a DeepSpeedExamples git mirror into tests/data.

A file is a DeepSpeed config by its content, not its name: a `.json` file of the tree that
parses as a JSON object with at least one top-level key DeepSpeed reads for training
(`DEEPSPEED_KEYS`). Files that are not JSON as committed (templates a script fills in, with
`${zero_stage}` or `BATCH_SIZE` placeholders) are listed, not copied. Each config is copied byte
for byte to `tests/data/deepspeedexamples_configs/<path with "/" as "__">`, and the README there
names the mirror's commit and what was found. `tests/passes/test_deepspeedexamples_configs.py`
reads them all.

    .venv/bin/python tools/deepspeedexamples_configs.py [/work/.mirror/deepspeedai+DeepSpeedExamples/repo]
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
MIRROR = pathlib.Path("/work/.mirror/deepspeedai+DeepSpeedExamples/repo")
OUT = ROOT / "tests" / "data" / "deepspeedexamples_configs"
DEEPSPEED_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                  "optimizer", "scheduler", "fp16", "bf16", "zero_optimization", "gradient_clipping",
                  "steps_per_print"}
"""Top-level keys of DeepSpeed's training config (runtime/config.py reads each), one of which a
DeepSpeed config has and other JSON files (HF model configs, eval data) do not."""


def git(mirror: pathlib.Path, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(mirror), *args], check=True, capture_output=True,
                          text=True).stdout


def main() -> int:
    mirror = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else MIRROR
    commit = git(mirror, "rev-parse", "HEAD").strip()
    paths = [p for p in git(mirror, "ls-tree", "-r", "--name-only", "HEAD").splitlines() if p.endswith(".json")]
    configs, not_json, other = [], [], 0
    for path in paths:
        show = subprocess.run(["git", "--git-dir", str(mirror), "show", f"HEAD:{path}"], capture_output=True)
        try:
            data = json.loads(show.stdout) if show.returncode == 0 else None
        except ValueError:
            not_json.append(path)
            continue
        if isinstance(data, dict) and DEEPSPEED_KEYS & set(data):
            configs.append(path)
            OUT.mkdir(parents=True, exist_ok=True)
            (OUT / path.replace("/", "__")).write_bytes(show.stdout)
        elif show.returncode != 0:
            not_json.append(f"{path} (not stored in the mirror)")
        else:
            other += 1
    readme = [
        "# DeepSpeedExamples' DeepSpeed configs, as committed",
        "",
        f"Copied byte for byte from github.com/deepspeedai/DeepSpeedExamples at commit `{commit}` by",
        "`tools/deepspeedexamples_configs.py`; each file is named by its path there, `/` written `__`.",
        "DeepSpeedExamples is licensed under the Apache License 2.0; the files are unchanged test data.",
        "",
        f"Of the tree's {len(paths)} `.json` files, {len(configs)} are JSON objects with a top-level key of",
        "DeepSpeed's training config (" + ", ".join(f"`{k}`" for k in sorted(DEEPSPEED_KEYS)) + "): those are here.",
        f"{other} are other JSON (model configs, eval data). {len(not_json)} are not JSON as committed (templates",
        "a script fills in, or not stored):",
        "",
        *[f"- `{p}`" for p in not_json],
        "",
        "`tests/passes/test_deepspeedexamples_configs.py` reads every one and says which fxzero reads and why the",
        "others are refused.",
    ]
    (OUT / "README.md").write_text("\n".join(readme) + "\n")
    print(f"{len(configs)} configs from {commit[:12]} into {OUT}; {len(not_json)} not JSON; {other} other JSON")
    return 0


if __name__ == "__main__":
    sys.exit(main())
