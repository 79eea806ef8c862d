"""The docs hold together: every relative link and anchor in README.md and docs/*.md resolves, every
``fastpersist-dist`` command they show names a subcommand and options the command line has, and the API
reference (docs/api.md: pdoc, from the docstrings) builds with every public name and its summary."""

from __future__ import annotations

import argparse
import glob
import html
import inspect
import os
import re
import subprocess
import sys

import pytest

import fastpersist_dist
from fastpersist_dist_cli import parser

pytestmark = pytest.mark.engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _text(page: str) -> str:
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


def _anchors(page: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+\s+(.*)$", FENCE.sub("", _text(page)), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", _text(page))):
            if re.match(r"^[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            linked = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(os.path.join(ROOT, linked)):
                broken.append(f"{page}: {target} (no such file)")
            elif anchor and linked.endswith(".md") and anchor not in _anchors(linked):
                broken.append(f"{page}: {target} (no such heading in {linked})")
    assert not broken, "\n".join(broken)


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_command_shown_exists_with_its_options():
    commands = _subcommands()
    unknown = []
    for page in PAGES:
        for line in re.findall(r"fastpersist-dist ([a-z][a-z-]*[^`\n|]*)", _text(page)):
            name, *words = line.split()
            if name not in commands:
                unknown.append(f"{page}: fastpersist-dist {name}")
                continue
            options = commands[name]._option_string_actions
            unknown += [f"{page}: fastpersist-dist {name} {w}" for w in words
                        if w.startswith("--") and w.split("=")[0] not in options]
    assert not unknown, "\n".join(unknown)


def test_the_api_reference_builds_with_every_public_name(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pdoc", "fastpersist_dist", "-o", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = (tmp_path / "fastpersist_dist.html").read_text()
    missing = []
    for name in fastpersist_dist.__all__:
        value = getattr(fastpersist_dist, name)
        if not (inspect.isclass(value) or inspect.isfunction(value)):
            continue
        summary = inspect.getdoc(value).splitlines()[0]
        if f'id="{name}"' not in page or html.escape(summary, quote=False).split("``")[0][:40] not in page:
            missing.append(f"{name}: {summary}")
    assert not missing, "\n".join(missing)
