"""The package's import structure: one way, no cycles, every module importable alone.

Dependencies run config -> ir -> trace / units / passes -> schedule -> cost -> runtime -> api;
the CLI and the viewers read recorded artifacts. The graph is read from the source (AST), the
imports inside functions included and `if TYPE_CHECKING:` blocks left out (they never run), and
an import of `a.b.c` from outside package `a.b` also counts as importing `a.b`'s and `a`'s
`__init__`, which Python runs first.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import networkx as nx
import pytest

import fxzero

ROOT = pathlib.Path(fxzero.__file__).parent

LAYER = {
    "fxzero._compat": 0, "fxzero.config": 0, "fxzero.zoo": 0, "fxzero.accelerator": 0,
    "fxzero.ir": 1, "fxzero.modelspec": 1,
    "fxzero.trace": 2, "fxzero.units": 2, "fxzero.passes": 2,
    "fxzero.schedule": 3,
    "fxzero.cost": 4, "fxzero.estimate": 4, "fxzero.liveness": 4,
    "fxzero.compiler": 5, "fxzero.runtime": 5,
    "fxzero.api": 6, "fxzero.artifacts": 6, "fxzero.deepspeed_api": 6, "fxzero.activation_estimate": 6,
    "fxzero.comm": 7, "fxzero.zero": 7, "fxzero.utils": 7, "fxzero.moe": 7, "fxzero.deepspeed_alias": 7,
    "fxzero.viz": 7, "fxzero.plan": 7,
    "fxzero.cli": 8,
    "fxzero._deepspeed_shim": 9,
    "fxzero": 0,
}
"""Each top-level part's layer: a module imports only from its own layer or below. The package
itself is at the bottom: its public names load lazily, so it imports nothing when it runs."""

COMPILER = ("fxzero.trace", "fxzero.units", "fxzero.passes", "fxzero.compiler")
"""What the runtime never imports: it runs what `fxzero.api` compiled and handed it."""


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: pathlib.Path, name: str) -> set[str]:
    """The fxzero modules `name` (at `path`) imports, as written."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in MODULES else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return {m for m in out if m == "fxzero" or m.startswith("fxzero.")}


def _runs(importer: str, imported: str) -> set[str]:
    """The modules an import of `imported` from `importer` runs: it and the __init__ of every
    package above it that `importer` is not inside."""
    parts = imported.split(".")
    ran = {imported}
    for i in range(1, len(parts)):
        pkg = ".".join(parts[:i])
        if not (importer == pkg or importer.startswith(pkg + ".")):
            ran.add(pkg)
    return ran & set(MODULES)


def _graph() -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(MODULES)
    for name, path in MODULES.items():
        for imported in _imports(path, name):
            for target in _runs(name, imported):
                if target != name:
                    g.add_edge(name, target)
    return g


def _part(module: str) -> str:
    return max((p for p in LAYER if module == p or module.startswith(p + ".")), key=len)


def test_no_import_cycles():
    cycles = list(nx.simple_cycles(_graph()))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in sorted(cycles)[:5])


def test_dependencies_run_one_way():
    back = []
    for a, b in _graph().edges:
        pa, pb = _part(a), _part(b)
        if pa == pb:
            continue
        if LAYER[pb] > LAYER[pa] or (pa == "fxzero.runtime" and pb in COMPILER) or (
                pa in COMPILER and pb in ("fxzero.runtime", "fxzero.api")):
            back.append(f"{a} -> {b}")
    assert not back, "imports that run back up the layers:\n" + "\n".join(sorted(back))


def test_the_graph_sees_the_imports_that_exist():
    """The walker itself: known arrows are found (a walker that finds nothing passes the rest)."""
    g = _graph()
    assert g.has_edge("fxzero.api", "fxzero.compiler")
    assert g.has_edge("fxzero.runtime.engine", "fxzero.runtime.executor")
    assert g.has_edge("fxzero.passes.prefetch", "fxzero.ir")  # runs the package __init__ first
    assert not g.has_edge("fxzero.runtime.autograd", "fxzero.runtime.engine")  # TYPE_CHECKING only


_IMPORT_EACH = """
import importlib, os, sys
import torch  # paid once; every child imports fxzero from scratch
failed, running = [], {}
names = sys.argv[1:]
fxzero_dir = os.path.join(os.getcwd(), "fxzero")


def third_party():
    # What fxzero's modules import from outside fxzero, found by one child importing them all:
    # the parent loads it once (sympy, networkx, torch.export, ...) so each child pays only for
    # fxzero's own modules, which it still imports from scratch.
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        for name in names:
            try:
                importlib.import_module(name)
            except BaseException:
                pass
        loaded = [m for m, mod in list(sys.modules.items()) if m.split(".")[0] != "fxzero"
                  and not (getattr(mod, "__file__", None) or "").startswith(fxzero_dir)]
        os.write(write, "\\n".join(loaded).encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 1 << 16):
        chunks.append(chunk)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode().split("\\n")


for module in third_party():
    if module not in sys.modules:
        try:
            importlib.import_module(module)
        except BaseException:
            pass
assert not any(m.split(".")[0] == "fxzero" for m in sys.modules), "the parent loaded fxzero itself"


def reap():
    pid, status = os.wait()
    if status:
        failed.append(running[pid])
    del running[pid]


for name in names:
    if len(running) >= (os.cpu_count() or 1):  # a child per core at a time
        reap()
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException as e:
            sys.stderr.write(f"{name}: {type(e).__name__}: {e}\\n")
            os._exit(1)
        os._exit(0)
    running[pid] = name
while running:
    reap()
print(" ".join(sorted(failed)))
sys.exit(1 if failed else 0)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="imports each module in a forked child")
@pytest.mark.timeout(300)
def test_every_module_imports_alone_in_a_fresh_interpreter():
    names = [m for m in MODULES if not m.endswith("__main__")]
    result = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *names], capture_output=True, text=True,
                            timeout=280, cwd=ROOT.parent)
    assert result.returncode == 0, f"modules that fail to import alone: {result.stdout}\n{result.stderr[-3000:]}"
