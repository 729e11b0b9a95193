"""docs/faults.md, the fault catalogue: every test it names exists, and it covers at least 20 cases."""

from __future__ import annotations

import ast
import functools
import pathlib
import re

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parents[2]
CATALOGUE = ROOT / "docs" / "faults.md"
TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)(?:\[[^\]]*\])?`")


def _rows() -> list[tuple[str, str, str]]:
    """(case, what the user sees, test cell) of every table row but the headers and rules."""
    rows = []
    for line in CATALOGUE.read_text().splitlines():
        if not line.startswith("|") or re.fullmatch(r"\|[\s|:-]+\|", line):
            continue
        # A cell may hold "|" only inside backticks; the test cell is the last one.
        case, _, rest = line.strip("|").partition("|")
        seen, _, test = rest.rpartition("|")
        if case.strip() == "case":
            continue
        rows.append((case.strip(), seen.strip(), test.strip()))
    return rows


@functools.cache
def _test_functions(path: str) -> frozenset[str]:
    tree = ast.parse((ROOT / path).read_text())
    return frozenset(node.name for node in ast.walk(tree)
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"))


def test_every_row_names_one_test_that_exists():
    rows = _rows()
    assert rows, f"no table rows found in {CATALOGUE}"
    missing = []
    for case, seen, cell in rows:
        refs = TEST_REF.findall(cell)
        assert len(refs) == 1, f"row {case!r}: the test column must name one `path::test_name`, got {cell!r}"
        assert case and seen, f"row {case!r}: a case and what the user sees are both needed"
        path, name = refs[0]
        if not (ROOT / path).is_file():
            missing.append(f"{case!r}: no file {path}")
        elif name not in _test_functions(path):
            missing.append(f"{case!r}: {path} has no test function {name}")
    assert not missing, "docs/faults.md names tests that do not exist:\n" + "\n".join(missing)


def test_at_least_twenty_cases_and_a_checkpoints_section():
    text = CATALOGUE.read_text()
    assert len(_rows()) >= 20, f"docs/faults.md lists {len(_rows())} cases; it should cover at least 20"
    assert "\n## Checkpoints\n" in text
