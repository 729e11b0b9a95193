"""Every code block the docs and the README mark as a complete program runs, as it is (the
convention: docs/contributing/docs.md). A block that raises fails its test, shown once on a
planted mistake."""

from __future__ import annotations

import pytest

from tests.docs.site import ROOT, Block, complete_blocks, pages, run_block

BLOCKS = [block for page in pages() for block in complete_blocks(page)]


def test_the_pages_users_start_from_have_complete_programs():
    where = {b.where.split(":")[0] for b in BLOCKS}
    assert {"README.md", "docs/getting-started.md"} <= where, sorted(where)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_a_complete_block_runs(block, tmp_path):
    result = run_block(block, tmp_path)
    assert result.returncode == 0, f"{block.where} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


def test_a_block_that_stops_running_fails(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Text.\n\n<!-- test: complete -->\n```python\nimport fxzero\n"
                    "fxzero.Config(stage=4)\n```\n")
    [block] = complete_blocks(page, root=tmp_path)
    assert block.where == "page.md:4" and block.ranks == 1
    result = run_block(block, tmp_path)
    assert result.returncode != 0 and "stage" in result.stderr


def test_a_marker_without_a_python_block_is_an_error(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- test: complete -->\n```bash\necho hi\n```\n")
    with pytest.raises(ValueError, match="page.md:2"):
        complete_blocks(page, root=tmp_path)
