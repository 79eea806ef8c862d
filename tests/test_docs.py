"""The docs hold together: every relative link and anchor in README.md and docs/*.md resolves, every
``fastpersist-dist`` command they show names a subcommand and options the command line has, the API
reference (docs/api.md: pdoc, from the docstrings) builds with every public name and its summary, the
benchmark results sit in the blocks that one command regenerates, and outside those blocks the docs
describe the product as it is: no dates, commit hashes or history (CHANGELOG.md keeps that)."""

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


# The blocks of results `fastpersist-dist report` rewrites whole, stamp line included: each a table of one run,
# dated and naming its commit, the only place in the docs where a run's figures, its date and its commit stand.
# A marker is a line of its own (indentation aside) outside fenced code, as the report reads them.
BLOCK = re.compile(r"<!-- report: (?P<name>\S+) (?P<end>begin|end) -->")
FENCE_LINE = re.compile(r" {0,3}(```|~~~)")
GENERATED = {"README.md": ("bench", "bench-train"), "docs/performance.md": ("bench-detail",)}
DATE = re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b")
# A commit hash, abbreviated or whole: 7 to 40 hex digits standing alone, at least one a digit and one a letter
# (neither a decimal number nor a word such as "defaced").
COMMIT = re.compile(r"\b(?=[0-9a-f]{0,39}[a-f])(?=[0-9a-f]{0,39}[0-9])[0-9a-f]{7,40}\b", re.I)
# A digest a format example shows is marked by its algorithm's name before it: "XXH3 " and its 16 hex digits.
DIGEST = re.compile(r"\bXXH3 [0-9a-f]{16}\b")
HISTORY = re.compile(r"\b(?:was|used to|measured again|re-?measured|(?:re-?)?run since)\b", re.I)
# The product's own words, quoted (an error message may say what "was not committed"), are not the docs' history;
# nor is "stays as it was" (unchanged).
QUOTED = re.compile(r"`[^`\n]*`|\"[^\"\n]*\"|\bas it was\b")


def _lines(page: str) -> list[tuple[int, str, "re.Match[str] | None"]]:
    """``page``'s lines, numbered from 1, each with its report marker (None: not a marker, or in fenced code)."""
    out, fenced = [], False
    for number, line in enumerate(_text(page).splitlines(), 1):
        if FENCE_LINE.match(line):
            fenced = not fenced
        out.append((number, line, None if fenced else BLOCK.fullmatch(line.strip())))
    return out


def _blocks(page: str) -> tuple[list[str], list[str]]:
    """The names of ``page``'s generated blocks, in order, and what is wrong with their markers."""
    names: list[str] = []
    problems: list[str] = []
    open_ = None
    for number, _, m in _lines(page):
        if m is None:
            continue
        if m["end"] == "begin":
            if open_ is not None:
                problems.append(f"{page}:{number}: block {m['name']} begins inside block {open_}")
            open_ = m["name"]
            names.append(m["name"])
        elif open_ != m["name"]:
            problems.append(f"{page}:{number}: block {m['name']} ends where {open_ or 'no block'} is open")
        else:
            open_ = None
    if open_ is not None:
        problems.append(f"{page}: block {open_} never ends")
    return names, problems


def test_the_generated_result_blocks_are_in_place():
    problems = []
    for page in PAGES:
        names, wrong = _blocks(page)
        problems += wrong
        problems += [f"{page}: block {n} appears {names.count(n)} times" for n in set(names) if names.count(n) > 1]
        problems += [f"{page}: no block {n}" for n in GENERATED.get(page, ()) if n not in names]
    assert not problems, "\n".join(problems)


def _outside_blocks(page: str) -> list[tuple[int, str]]:
    """``page``'s lines, numbered from 1, but those inside its generated blocks (their markers included)."""
    kept, inside = [], False
    for number, line, m in _lines(page):
        if m is not None:
            inside = m["end"] == "begin"
        elif not inside:
            kept.append((number, line))
    return kept


def test_the_docs_carry_no_dates_commit_hashes_or_history_outside_the_generated_blocks():
    found = []
    for page in PAGES:
        for number, line in _outside_blocks(page):
            what = [m.group() for m in DATE.finditer(line)]
            what += [m.group() for m in COMMIT.finditer(DIGEST.sub("", line))]
            what += [m.group() for m in HISTORY.finditer(QUOTED.sub("", line))]
            if what:
                found.append(f"{page}:{number}: {', '.join(what)}: {line.strip()[:120]}")
    assert not found, "\n".join(found)
