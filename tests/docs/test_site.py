"""The documentation site builds offline with warnings as errors, and the build catches the
mistakes a page can make: a link to a page that does not exist, an API name that does not
exist, a snippet of a file that does not exist. Each mistake is planted in a copy of the
sources and the build must fail naming it."""

from __future__ import annotations

import pathlib
import re

import pytest

from tests.docs.site import ROOT, build, copy_site_sources

pytest.importorskip("mkdocs", reason="the site's generator is installed by scripts/setup.sh (requirements.txt)")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("site")
    result = build(ROOT, out)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    warnings = [line for line in result.stderr.splitlines() if line.startswith("WARNING")]
    assert not warnings, "\n".join(warnings)
    return out


def test_every_page_in_the_nav_is_built(site):
    for page in ("index.html", "getting-started.html", "concepts.html", "guides/deepspeed.html",
                 "reference/config.html", "reference/engine.html", "reference/cli.html", "benchmarks.html",
                 "deepspeed_config.html", "faults.html", "activations.html", "changelog.html"):
        assert (site / page).is_file(), page


def test_the_site_reads_offline(site):
    """No page loads a font, style or script from another host (the theme's web fonts are off)."""
    for page in site.rglob("*.html"):
        remote = re.findall(r'<(?:link|script)[^>]+(?:href|src)="(https?://[^"]+)"', page.read_text())
        assert not remote, (page.relative_to(site), remote)


def test_the_api_reference_shows_the_fields_docstrings(site):
    """Generated from the code, not copied: each text below is written only in a docstring."""
    import fxzero.config.config as config_module

    html = (site / "reference" / "config.html").read_text()
    source = pathlib.Path(config_module.__file__).read_text()
    for field, phrase in (("persist_threshold", "stay gathered for the whole step"),
                          ("collective_timeout", "Seconds any collective waits for the other ranks")):
        assert phrase in source, f"the docstring of Config.{field} changed; pick another phrase"
        assert f'id="fxzero.config.config.Config.{field}"' in html
        assert phrase in html, field
    engine = (site / "reference" / "engine.html").read_text()
    for method in ("backward", "step", "save_checkpoint", "memory_report"):
        assert f'id="fxzero.runtime.engine.Engine.{method}"' in engine, method


def test_the_cli_reference_is_each_commands_help(site):
    from click.testing import CliRunner

    from fxzero.cli import main

    html = (site / "reference" / "cli.html").read_text()
    assert "Sentinel" not in html  # click 8.5's UNSET default, which mkdocs-click's table style shows
    for command in ("compile", "graph", "schedule", "estimate", "train", "export", "run", "wall"):
        assert f"fxzero {command}" in html, command
        help_text = CliRunner().invoke(main, [command, "--help"]).output
        first_line = help_text.split("\n\n")[1].strip().splitlines()[0]  # the docstring's first line
        assert first_line.split()[0] in html, (command, first_line)


def test_the_changelog_page_is_the_changelog(site):
    first = next(line for line in (ROOT / "CHANGELOG.md").read_text().splitlines() if line.startswith("## "))
    assert first[3:].split()[0] in (site / "changelog.html").read_text()


def test_the_readmes_links_name_files_that_exist():
    """The README is read on the repository's page, not built: its relative links are checked here."""
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    relative = [t for t in targets if "://" not in t]
    assert len(relative) >= 10, relative  # the walker finds them
    missing = [t for t in relative if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def _plant(tmp_path: pathlib.Path, page: str, text: str) -> str:
    root = copy_site_sources(tmp_path / "src")
    with open(root / "docs" / page, "a") as f:
        f.write("\n\n" + text + "\n")
    result = build(root, tmp_path / "site")
    assert result.returncode != 0, f"the build passed with a planted mistake: {text!r}"
    return result.stderr


def test_every_warning_a_page_can_raise_is_named_by_one_build(tmp_path):
    """Four mistakes the build reports as warnings (strict mode then fails it), planted together
    on three pages in one build (one build instead of four: each takes seconds): a link to a
    missing page, a link to a missing anchor, a cross-reference to an API name that does not exist, and a docstring naming
    a parameter that no longer exists (a renamed argument: the reference would lie). Each must be
    named in the build's output."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "planted_api.py").write_text(
        'def scale(x, factor=2):\n    """Scale x.\n\n    Args:\n        x: the value.\n'
        '        ratio: what it is multiplied by.\n    """\n    return x * factor\n')
    root = copy_site_sources(tmp_path / "src")
    for page, text in (("guides/deepspeed.md", "See [the old page](no_such_page.md)."),
                       ("guides/deepspeed.md", "See [units](../concepts.md#no-such-section)."),
                       ("guides/fsdp2.md", "Set [the stage][fxzero.config.config.Config.no_such_field]."),
                       ("reference/api.md", "::: planted_api.scale")):
        with open(root / "docs" / page, "a") as f:
            f.write("\n\n" + text + "\n")
    result = build(root, tmp_path / "site")
    assert result.returncode != 0, "the build passed with four planted mistakes"
    err = result.stderr
    assert "no_such_page.md" in err and "not found" in err
    assert "no-such-section" in err
    assert "fxzero.config.config.Config.no_such_field" in err
    assert "ratio" in err and "does not appear in the function signature" in err


def test_an_api_name_that_does_not_exist_fails_the_build(tmp_path):
    err = _plant(tmp_path, "reference/config.md", "::: fxzero.config.config.NoSuchPolicy")
    assert "fxzero.config.config.NoSuchPolicy" in err
