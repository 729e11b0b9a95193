"""Fixtures for the CLI tests: a runner, and small models compiled once per module."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from fxzero.cli import main

# Small enough to compile in about a second and to draw every node with `dot`.
TINY = "gpt-tiny(n_blocks=2)"
WORLD = 2


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    """No launcher variables leak in: the CLI traces without ranks."""
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="session")
def runner() -> CliRunner:
    return CliRunner()


def invoke(runner: CliRunner, *args: str, ok: bool = True):
    """Run `fxzero ARGS`; with ok=True assert it succeeded and show its output if not."""
    result = runner.invoke(main, list(args), catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, runner) -> str:
    """Artifacts of `fxzero compile` for a 2-block GPT on 2 ranks, written once."""
    out = str(tmp_path_factory.mktemp("tiny") / "art")
    invoke(runner, "compile", TINY, "--world", str(WORLD), "-o", out)
    return out


def one_line_error(result, *needles: str) -> None:
    """A CLI mistake's contract: exit code 1, no traceback, one `Error:` line holding every needle."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, result.output
    for needle in needles:
        assert needle in lines[0], result.output
