"""The docs' report blocks: the lines between ``<!-- report: NAME begin -->`` and ``<!-- report: NAME end -->``.

Each marker is an HTML comment on a line of its own (outside fenced code, so
a page can show the syntax). Only a block's inside is ever rewritten; every
byte outside the blocks stays as it was. Pure text in, text out: the file
functions at the end only read and write what the pure ones return.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

MARKER = re.compile(r"<!-- report: (?P<name>\S+) (?P<edge>begin|end) -->")
MARKER_START = "<!-- report:"
FENCE = re.compile(r" {0,3}(```|~~~)")


class BlockError(ValueError):
    """Report blocks that cannot be filled; the message names the file, line and block."""


@dataclass(frozen=True)
class Block:
    """One block of a text: its name, its begin marker's line (1-based), and the offsets of its inside."""

    name: str
    line: int
    start: int  # just after the begin marker's line
    stop: int  # at the start of the end marker's line


def find_blocks(text: str, source: str) -> list[Block]:
    """The report blocks of ``text`` (the file ``source``), in order; :class:`BlockError` where a marker is
    malformed, a block has no end, an end no begin, blocks nest, or a name appears twice."""
    blocks: list[Block] = []
    seen: dict[str, int] = {}
    opened: Optional[tuple[str, int, int]] = None  # name, line, start
    fenced = False
    offset = 0
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        here, offset = offset, offset + len(line)
        if FENCE.match(line):
            fenced = not fenced
        stripped = line.strip()
        if fenced or not stripped.startswith(MARKER_START):
            continue
        marker = MARKER.fullmatch(stripped)
        if marker is None:
            raise BlockError(f"{source}:{number}: malformed report marker {stripped!r} "
                             "(expected '<!-- report: NAME begin -->' or '<!-- report: NAME end -->')")
        name = marker["name"]
        if marker["edge"] == "begin":
            if opened is not None:
                raise BlockError(f"{source}:{number}: block '{name}' begins inside block '{opened[0]}' "
                                 f"(begun at line {opened[1]}, not ended)")
            if name in seen:
                raise BlockError(f"{source}:{number}: block '{name}' appears twice (also at line {seen[name]})")
            seen[name] = number
            opened = (name, number, offset)
        elif opened is None:
            raise BlockError(f"{source}:{number}: end of block '{name}' without its begin")
        elif opened[0] != name:
            raise BlockError(f"{source}:{number}: end of block '{name}' inside block '{opened[0]}' "
                             f"(begun at line {opened[1]})")
        else:
            blocks.append(Block(name, opened[1], opened[2], here))
            opened = None
    if opened is not None:
        raise BlockError(f"{source}:{opened[1]}: block '{opened[0]}' begins here and never ends "
                         f"(no '<!-- report: {opened[0]} end -->' after it)")
    return blocks


def check_names(blocks: Iterable[Block], source: str, known: Iterable[str]) -> None:
    """:class:`BlockError` naming the first block of ``source`` whose name the report does not render."""
    names = sorted(known)
    for block in blocks:
        if block.name not in names:
            raise BlockError(f"{source}:{block.line}: unknown report block '{block.name}' "
                             f"(the report renders: {', '.join(names)})")


def replace_blocks(text: str, rendered: Mapping[str, str], source: str, known: Iterable[str]) -> str:
    """``text`` with the inside of each block replaced by its markdown in ``rendered``, set off by blank lines;
    everything outside the blocks unchanged. A block the report does not know (``known``), or one this
    report has no results for, is a :class:`BlockError` naming ``source`` and the block."""
    blocks = find_blocks(text, source)
    check_names(blocks, source, known)
    pieces, done = [], 0
    for block in blocks:
        if block.name not in rendered:
            raise BlockError(f"{source}:{block.line}: block '{block.name}' has no results in this report "
                             f"(it holds: {', '.join(sorted(rendered)) or 'none'})")
        newline = "\r\n" if text[block.start - 2:block.start] == "\r\n" else "\n"
        body = rendered[block.name].strip("\n").replace("\n", newline)
        pieces += [text[done:block.start], newline, body, newline, newline]
        done = block.stop
    pieces.append(text[done:])
    return "".join(pieces)


def _read(path: str) -> str:
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def check_pages(paths: Iterable[str], known: Iterable[str]) -> dict[str, list[str]]:
    """Each page's block names, in order (pages without blocks left out); :class:`BlockError` for broken or
    unknown blocks, and for a block that appears on two pages (one place for each table)."""
    known = tuple(known)
    found: dict[str, list[str]] = {}
    where: dict[str, str] = {}
    for path in paths:
        blocks = find_blocks(_read(path), path)
        check_names(blocks, path, known)
        for block in blocks:
            if block.name in where:
                raise BlockError(f"{path}:{block.line}: block '{block.name}' appears twice (also in "
                                 f"{where[block.name]})")
            where[block.name] = path
        if blocks:
            found[path] = [b.name for b in blocks]
    return found


def update_pages(paths: Iterable[str], rendered: Mapping[str, str], known: Iterable[str]) -> dict[str, list[str]]:
    """Fill the blocks of every page; write the pages whose text changed. Every page is checked before any
    is written. Returns each page's filled blocks (pages without blocks left out)."""
    known = tuple(known)
    filled = check_pages(paths, known)
    texts = {path: _read(path) for path in filled}
    new = {path: replace_blocks(text, rendered, path, known) for path, text in texts.items()}
    for path, text in new.items():
        if text != texts[path]:
            with open(path, "w", encoding="utf-8", newline="") as f:
                f.write(text)
    return filled
