"""Render DOT source with graphviz's own `dot` binary."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess

__all__ = ["DotError", "dot_formats", "find_dot", "render"]

INSTALL_HINT = (
    "install graphviz (Debian/Ubuntu: `sudo apt-get install graphviz`; macOS: `brew install "
    "graphviz`; conda: `conda install graphviz`), or write the DOT source with --format dot"
)
SOURCE_FORMATS = ("dot", "gv")
"""Formats written as the DOT source itself, without running `dot`."""


class DotError(RuntimeError):
    """`dot` is missing, cannot write a format, or failed; the message says what to do."""


def find_dot() -> str:
    """Path of the `dot` binary on PATH.

    Raises:
        DotError: when it is not installed.
    """
    path = shutil.which("dot")
    if path is None:
        raise DotError(f"graphviz's `dot` binary was not found on PATH; {INSTALL_HINT}")
    return path


@functools.lru_cache(maxsize=4)
def dot_formats(dot: str) -> tuple[str, ...]:
    """The output formats this `dot` can write (it lists them when asked for format '?')."""
    proc = subprocess.run([dot, "-T?"], capture_output=True, text=True, timeout=30)
    listing = proc.stderr + proc.stdout
    m = re.search(r"Use one of:(.*)", listing, re.S)
    if not m:
        return ()
    return tuple(sorted({f.split(":")[0] for f in m.group(1).split()}))


def render(source: str, fmt: str, *, timeout_s: float = 300) -> bytes:
    """`source` rendered to `fmt` ("svg", "png", "pdf", ...; "dot" returns the source).

    Raises:
        DotError: `dot` is missing, cannot write `fmt`, or fails.
    """
    if fmt in SOURCE_FORMATS:
        return source.encode()
    dot = find_dot()
    formats = dot_formats(dot)
    if formats and fmt not in formats:
        common = [f for f in ("svg", "png", "pdf", "dot") if f in formats or f == "dot"]
        raise DotError(
            f"`dot` cannot write format {fmt!r}; use one of {', '.join(common)} "
            f"(this graphviz also knows: {', '.join(f for f in formats if f not in common)})"
        )
    try:
        proc = subprocess.run([dot, f"-T{fmt}"], input=source.encode(), capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise DotError(
            f"`dot` did not finish within {timeout_s:.0f} s; draw fewer nodes with --collapse or --unit NAME"
        ) from None
    if proc.returncode != 0:
        message = proc.stderr.decode(errors="replace").strip().splitlines()
        raise DotError(f"`dot -T{fmt}` failed: {message[0] if message else f'exit code {proc.returncode}'}")
    return proc.stdout
