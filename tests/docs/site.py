"""Helpers of the docs tests: build the site from a copy, and find the code blocks pages mark.

A Python block preceded by `<!-- test: complete -->` is a program that runs as it is;
`<!-- test: complete, torchrun=2 -->` runs it on 2 gloo ranks. Every other block is an excerpt.
The convention is written down in docs/contributing/docs.md.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parents[2]

MARKER = re.compile(r"^<!-- test: complete(?:, torchrun=(\d+))? -->\s*$")
FENCE = re.compile(r"^```(\w*)")


class Block(NamedTuple):
    """A complete program found in a page: where it is, how many ranks run it, its source."""

    where: str  # "docs/getting-started.md:34", the line of the opening fence
    ranks: int  # 1: plain python; more: torchrun --nproc_per_node
    source: str


def complete_blocks(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[Block]:
    """The marked blocks of one Markdown page; a marker not followed by a ```python fence is an error."""
    lines = path.read_text().splitlines()
    out = []
    inside = ""  # the fence of the block we are in ("" outside): a marker quoted in a block is text
    for i, line in enumerate(lines):
        ticks = re.match(r"^(`{3,})", line)
        if ticks and (not inside or ticks.group(1) == inside):
            inside = "" if inside else ticks.group(1)
            continue
        m = MARKER.match(line)
        if inside or not m:
            continue
        where = f"{path.relative_to(root)}:{i + 2}"
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if fence is None or fence.group(1) != "python":
            raise ValueError(f"{where}: '<!-- test: complete -->' must stand right above a ```python block")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{where}: the block never closes")
        out.append(Block(where, int(m.group(1) or 1), "\n".join(lines[i + 2:end]) + "\n"))
    return out


def pages(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """Every page whose blocks are checked: the site's sources and the README."""
    return sorted(root.joinpath("docs").rglob("*.md")) + [root / "README.md"]


def run_block(block: Block, cwd: pathlib.Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run a complete block as a script in `cwd` (its own empty folder)."""
    script = cwd / "block.py"
    script.write_text(block.source)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a block under test is its own job, not part of a caller's world
    if block.ranks == 1:
        cmd = [sys.executable, str(script)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={block.ranks}",
               str(script)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def copy_site_sources(dest: pathlib.Path) -> pathlib.Path:
    """A copy of what the site is built from (mkdocs.yml, docs/, CHANGELOG.md), with the package
    linked in, so a test can plant a mistake without touching the checkout."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "mkdocs.yml", dest / "mkdocs.yml")
    shutil.copy(ROOT / "CHANGELOG.md", dest / "CHANGELOG.md")
    shutil.copytree(ROOT / "docs", dest / "docs")
    (dest / "fxzero").symlink_to(ROOT / "fxzero")
    return dest


def no_network() -> list[str]:
    """A command prefix that runs its command with no network (a new network namespace, `unshare
    -n`, where this machine lets us make one: as root, as CI runs), else nothing."""
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-n", "true"], capture_output=True).returncode == 0:
        return [unshare, "-n"]
    return []


def build(root: pathlib.Path, site_dir: pathlib.Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of the sources under `root` into `site_dir`: offline where
    `no_network()` can make it so, warnings are errors."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONPATH=str(root))
    cmd = [*no_network(), sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
           str(root / "mkdocs.yml"), "--site-dir", str(site_dir)]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=240)
