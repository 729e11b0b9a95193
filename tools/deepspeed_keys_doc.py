"""Rewrite the generated part of docs/deepspeed_config.md from the key table in code.

The part between `<!-- keys:begin -->` and `<!-- keys:end -->` is
`fxzero.config.deepspeed_keys.markdown_table()`; the prose around it is written by hand and
left as it is. `tests/passes/test_deepspeed_docs.py` fails when the two differ.

    .venv/bin/python tools/deepspeed_keys_doc.py          # rewrite the doc
    .venv/bin/python tools/deepspeed_keys_doc.py --check  # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from anywhere

from fxzero.config.deepspeed_keys import markdown_table  # noqa: E402

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "deepspeed_config.md"
BEGIN, END = "<!-- keys:begin -->\n", "<!-- keys:end -->"


def split(text: str) -> tuple[str, str, str]:
    """(before and including the begin marker, the generated part, the end marker and after)."""
    start, stop = text.find(BEGIN), text.find(END)
    if start < 0 or stop < start:
        raise ValueError(f"{DOC.name} needs the markers {BEGIN.strip()!r} and then {END!r}, each on its own line")
    start += len(BEGIN)
    return text[:start], text[start:stop], text[stop:]


def regenerated(text: str) -> str:
    """`text` with its generated part replaced by the table in code."""
    before, _, after = split(text)
    return before + markdown_table() + after


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the doc differs from the table; write nothing")
    args = parser.parse_args()
    text = DOC.read_text()
    new = regenerated(text)
    if args.check:
        if new != text:
            print(f"{DOC} is stale: run .venv/bin/python tools/deepspeed_keys_doc.py", file=sys.stderr)
            return 1
        return 0
    if new != text:
        DOC.write_text(new)
        print(f"rewrote the key tables in {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
