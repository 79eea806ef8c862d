"""The package's layers: every import points down the order of docs/development.md, and none goes round.

Read from the source (every ``import`` statement, those inside functions too), so a lazy import
cannot hide an arrow back up. A module may import its own subpackage and the layers below it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fastpersist_dist", "fastpersist_dist_cli")
# Bottom first. Siblings on one rank do not import each other.
RANKS = {
    "util": 0,
    "format": 1,
    "plan": 2, "storage": 2,
    "engine": 3,
    "compat": 4,
    "strategies": 5,
    "registry": 6, "integrations": 6,
    "tools": 7,
}
# The public surface: the package itself and the entry points users import or run with -m.
SURFACE = {"fastpersist_dist", "fastpersist_dist.dcp", "fastpersist_dist.megatron_lm", "fastpersist_dist.nemo",
           "fastpersist_dist.torchtitan", "fastpersist_dist.verify"}
pytestmark = pytest.mark.engine


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports (``from pkg import mod`` names the module)."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = ".".join(base[: len(base) - node.level + 1] + [node.module or ""]).strip(".") if node.level \
                else node.module or ""
            subs = [f"{target}.{alias.name}" for alias in node.names]
            out.update(s for s in subs if s in modules)
            if any(s not in modules for s in subs):
                out.add(target)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    resolved = set()
    for target in out:
        while target and target not in modules:  # a name inside a module: the module
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.add(target)
    return resolved


def _rank(module: str) -> tuple[str, int]:
    if module.startswith("fastpersist_dist_cli"):
        return "command line", len(RANKS) + 2
    if module in SURFACE:
        return "public surface", len(RANKS) + 1
    layer = module.split(".")[1]
    return layer, RANKS[layer]


GRAPH = {name: _imports(name, path, _modules()) for name, path in _modules().items()}


def test_every_module_belongs_to_a_layer():
    assert not [m for m in GRAPH if m not in SURFACE and not m.startswith("fastpersist_dist_cli")
                and m.split(".")[1] not in RANKS]


def test_imports_point_down_the_layers():
    up = [f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets
          if _rank(a)[0] != _rank(b)[0] and _rank(b)[1] >= _rank(a)[1]]
    assert not up, "imports against the layer order:\n" + "\n".join(sorted(up))


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(GRAPH.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(GRAPH):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_writer_process_imports_only_the_write_path():
    """A rank's writer imports its module and what writing needs: no megatron-core, index, plan or commit."""
    probe = ("import sys; import fastpersist_dist.engine.writer_process; "
             "print('\\n'.join(sorted(m for m in sys.modules if m.startswith(('fastpersist_dist', 'megatron')))))")
    env = {**os.environ, "FASTPERSIST_WRITER_PROCESS": "1"}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    loaded = set(proc.stdout.split())
    unused = {"megatron", "fastpersist_dist.engine.commit", "fastpersist_dist.engine.index_reader",
              "fastpersist_dist.engine.directory", "fastpersist_dist.format.index_pages",
              "fastpersist_dist.format.dcp_metadata", "fastpersist_dist.plan", "fastpersist_dist.strategies",
              "fastpersist_dist.compat"}
    assert not {m for m in loaded if m in unused or m.split(".")[0] in unused}, sorted(loaded)
