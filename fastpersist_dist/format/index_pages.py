"""Index version 3: a small top level plus one part file per planning group, cut into pages. Pure (no I/O).

At 16k ranks one JSON index of every record is a gigabyte that every loading
rank would parse whole. Version 3 splits it:

* ``fastpersist_index.json`` (the top level, still the commit marker) names
  each key once (kind, dtype, global shape) with its pages: ``[group, low,
  high, offset, length, xxh3]``, the bounding box of the page's records and
  where the page lies in its group's part file.
* ``fastpersist_index.g<group>.json`` (``group``: the planning group's first
  rank) holds the records that group wrote, key by key, as pages back to back.
  A page is canonical JSON ``{"key", "files", "records"}`` (``files``: the
  sizes of the data files its records point to) and is checked against its
  XXH3 in the top level before it is parsed.

A loading rank reads the top level and then only the pages whose boxes meet
the boxes it requests (:func:`select_pages`). Small parts are one page: every
page costs the top level an entry, which every loading rank reads.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from ..util.errors import CorruptCheckpointError
from .checksum import ALGORITHM, digest_bytes
from .coverage import record_extents
from .records import (
    BACKEND,
    FORMAT_VERSIONS,
    KIND_OBJECT,
    KIND_TENSOR,
    CheckpointIndex,
    ShardRecord,
    _canonical,
    _int,
    _int_tuple,
    check_file_name,
    checked_body,
    checksum_block,
    commit_fields,
    dtype_from_name,
    record_from_json,
    record_to_json,
)

PAGED_VERSION = 3
PART_FILE_RE = re.compile(r"^fastpersist_index\.g(\d{5,})\.json$")
PAGE_RECORDS = 512  # a part is cut into pages of about this many records ...
MAX_PAGES = 8  # ... and at most this many (a part of <= PAGE_RECORDS records is one page)

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (low, high): elements low <= i < high per axis


def part_file_name(group: int) -> str:
    """The part file of the planning group whose first rank is ``group``."""
    return f"fastpersist_index.g{group:05d}.json"


@dataclass(frozen=True)
class Page:
    """One page of a part: its key, group, bounding box and byte range in the part file."""

    key: str
    group: int
    low: tuple[int, ...]
    high: tuple[int, ...]
    offset: int
    length: int
    xxh3: str

    @property
    def part_file(self) -> str:
        """Name of the part file holding this page."""
        return part_file_name(self.group)

    def to_json(self) -> list:
        """The page's entry in the top level (its key is the entry's)."""
        return [self.group, list(self.low), list(self.high), self.offset, self.length, self.xxh3]

    def describe(self) -> str:
        """For error messages: file, key and bytes."""
        return f"page of '{self.key}' in {self.part_file} (bytes {self.offset}+{self.length})"


@dataclass(frozen=True)
class KeyEntry:
    """What the top level says about one key: enough for metadata queries without reading a page."""

    kind: str
    dtype: Optional[str]
    global_shape: tuple[int, ...]
    pages: tuple[Page, ...]


@dataclass(frozen=True)
class PagedIndex:
    """The parsed top level of a version-3 index."""

    world_size: int
    checksum_block_bytes: int
    container: str
    keys: dict[str, KeyEntry]
    parts: dict[str, int]  # part file name -> size in bytes
    metadata_xxh3_64: Optional[str] = None
    aux_files: dict[str, str] = field(default_factory=dict)

    def to_json_bytes(self) -> bytes:
        """The top level with a checksum over its canonical body (compact: every loading rank reads it)."""
        body: dict[str, Any] = {
            "format": BACKEND, "format_version": PAGED_VERSION, "container": self.container,
            "world_size": self.world_size, "checksum_algorithm": ALGORITHM,
            "checksum_block_bytes": self.checksum_block_bytes, "metadata_xxh3_64": self.metadata_xxh3_64,
            "aux_files": dict(sorted(self.aux_files.items())), "parts": dict(sorted(self.parts.items())),
            "keys": {k: {"kind": e.kind, "dtype": e.dtype, "global_shape": list(e.global_shape),
                         "pages": [p.to_json() for p in e.pages]} for k, e in sorted(self.keys.items())},
        }
        return json.dumps({"body_xxh3_64": digest_bytes(_canonical(body)), "body": body},
                          separators=(",", ":")).encode()

    @property
    def pages(self) -> list[Page]:
        """Every page, key by key."""
        return [p for e in self.keys.values() for p in e.pages]

    def whole(self, pages: Iterable[tuple[Page, bytes]], where: str) -> CheckpointIndex:
        """A :class:`CheckpointIndex` of the records of ``pages`` (each checked and parsed here)."""
        files: dict[str, int] = {}
        records: list[ShardRecord] = []
        for page, data in pages:
            page_files, page_records = parse_page(self, page, data, where)
            for name, size in page_files.items():
                if files.setdefault(name, size) != size:
                    raise CorruptCheckpointError(
                        f"{where}: {page.describe()} gives {name} {size} bytes, another page {files[name]}")
            records.extend(page_records)
        return CheckpointIndex(
            world_size=self.world_size, checksum_block_bytes=self.checksum_block_bytes, files=files,
            records=tuple(records), container=self.container, metadata_xxh3_64=self.metadata_xxh3_64,
            aux_files=dict(self.aux_files),
        )


def record_bounds(r: ShardRecord) -> Box:
    """The bounding box of the elements a record holds (an object: its one cell of the object grid)."""
    if r.kind != KIND_TENSOR:
        return r.global_offset, tuple(o + 1 for o in r.global_offset)
    extents = record_extents(r)
    low = tuple(min(e.offset[a] for e in extents) for a in range(len(r.global_offset)))
    high = tuple(max(e.offset[a] + e.shape[a] for e in extents) for a in range(len(r.global_offset)))
    return low, high


def _union(boxes: list[Box]) -> Box:
    return (tuple(min(c) for c in zip(*(b[0] for b in boxes))),
            tuple(max(c) for c in zip(*(b[1] for b in boxes))))


def meets(a: Box, b: Box) -> bool:
    """Whether two boxes share an element."""
    return all(lo1 < hi2 and lo2 < hi1 for lo1, hi1, lo2, hi2 in zip(a[0], a[1], b[0], b[1]))


def _page_bytes(key: str, records: list[ShardRecord], files: dict[str, int], container: str) -> bytes:
    used = {r.file for r in records}
    doc = {"key": key, "files": {n: files[n] for n in sorted(used)},
           "records": [record_to_json(r, container) for r in records]}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def build_part(records: list[ShardRecord], group: int, files: dict[str, int],
               container: str) -> tuple[bytes, list[Page]]:
    """One planning group's part file and its pages: per key, records in order along one axis, cut into pages.

    The axis is the one where the records lie most side by side (the part's
    extent over a record's mean extent: e.g. a distributed optimizer's DP
    slices, rather than the layers stacked in a key), so each page covers a
    slab that a loading rank reads only if its request meets it.
    """
    by_key: dict[str, list[ShardRecord]] = {}
    for r in records:
        by_key.setdefault(r.key, []).append(r)
    data = bytearray()
    pages = []
    for key, recs in sorted(by_key.items()):
        bounds = [record_bounds(r) for r in recs]
        low, high = _union(bounds)
        mean = [sum(b[1][a] - b[0][a] for b in bounds) / len(bounds) for a in range(len(low))]
        axis = max(range(len(low)), key=lambda a: (high[a] - low[a]) / max(mean[a], 1), default=0)
        order = sorted(range(len(recs)), key=lambda i: (bounds[i][0][axis:axis + 1], bounds[i][0],
                                                        recs[i].flattened_range or (0, 0)))
        count = min(MAX_PAGES, max(1, -(-len(recs) // PAGE_RECORDS)))
        size = -(-len(recs) // count)
        for start in range(0, len(recs), size):
            chunk = order[start : start + size]
            blob = _page_bytes(key, [recs[i] for i in chunk], files, container)
            low, high = _union([bounds[i] for i in chunk])
            pages.append(Page(key, group, low, high, len(data), len(blob), digest_bytes(blob)))
            data += blob
    return bytes(data), pages


def top_level(pages: Iterable[Page], kinds: dict[str, tuple[str, Optional[str], tuple[int, ...]]],
              parts: dict[str, int], world_size: int, block: int, container: str,
              aux_files: Optional[dict[str, str]] = None, metadata_xxh3_64: Optional[str] = None) -> PagedIndex:
    """The top level from every group's pages; ``kinds``: key -> (kind, dtype, global shape)."""
    by_key: dict[str, list[Page]] = {}
    for p in pages:
        by_key.setdefault(p.key, []).append(p)
    keys = {k: KeyEntry(*kinds[k], tuple(sorted(ps, key=lambda p: (p.group, p.offset)))) for k, ps in by_key.items()}
    return PagedIndex(world_size, block, container, keys, dict(parts), metadata_xxh3_64, dict(aux_files or {}))


def key_kinds(records: Iterable[ShardRecord]) -> dict[str, tuple[str, Optional[str], tuple[int, ...]]]:
    """Kind, dtype and global shape per key, as the top level names them."""
    return {r.key: (r.kind, r.dtype, r.global_shape) for r in records}


def select_pages(index: PagedIndex, wants: dict[str, list[Box]]) -> list[Page]:
    """The pages a loading rank needs: those of requested keys whose box meets a requested box.

    A requested key whose boxes meet no page (an empty tensor, or a request past
    the saved shape) still gets its first page, so the loader sees the key and
    its saved shape.
    """
    chosen = []
    for key, boxes in sorted(wants.items()):
        entry = index.keys.get(key)
        if entry is None:
            continue
        hit = [p for p in entry.pages if any(meets((p.low, p.high), b) for b in boxes)]
        chosen.extend(hit or entry.pages[:1])
    return chosen


def parse_page(index: PagedIndex, page: Page, data: bytes, where: str) -> tuple[dict[str, int], list[ShardRecord]]:
    """A page's file sizes and records, after checking its XXH3 and that it holds what the top level says."""
    at = f"{where}: {page.describe()}"
    if len(data) != page.length or digest_bytes(data) != page.xxh3:
        raise CorruptCheckpointError(f"{at}: checksum mismatch (the part file is damaged or truncated)")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{at}: not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("key") != page.key or not isinstance(doc.get("files"), dict) \
            or not isinstance(doc.get("records"), list):
        raise CorruptCheckpointError(f"{at}: not a page of '{page.key}'")
    files = doc["files"]
    for name, size in files.items():
        check_file_name(name, at, index.container)
        _int(size, f"size of {name}", at)
    records = [record_from_json(r, at, files, index.checksum_block_bytes, index.container) for r in doc["records"]]
    entry = index.keys[page.key]
    for r in records:
        low, high = record_bounds(r)
        if r.key != page.key or (r.kind, r.dtype, r.global_shape) != (entry.kind, entry.dtype, entry.global_shape) \
                or any(l < pl for l, pl in zip(low, page.low)) or any(h > ph for h, ph in zip(high, page.high)):
            raise CorruptCheckpointError(f"{at}: record {r.describe()} is not what the top level lists for this page")
    return files, records


def is_paged(doc: Any) -> bool:
    """Whether a parsed index document is a version-3 top level (else versions 1/2: one whole index)."""
    return isinstance(doc, dict) and isinstance(doc.get("body"), dict) and doc["body"].get("format_version") == PAGED_VERSION


def parse_top(doc: dict, where: str) -> PagedIndex:
    """Validate a version-3 top level (the caller parsed the JSON); every problem raises CorruptCheckpointError."""
    body = checked_body(doc, where)
    container = body.get("container")
    if container not in FORMAT_VERSIONS:
        raise CorruptCheckpointError(f"{where}: unknown container {container!r}")
    digest, aux = commit_fields(body, container, where)
    parts = body.get("parts")
    if not isinstance(parts, dict) or not all(isinstance(n, str) and PART_FILE_RE.match(n) for n in parts):
        raise CorruptCheckpointError(f"{where}: 'parts' must map part file names to sizes, got {parts!r}")
    for name, size in parts.items():
        _int(size, f"size of {name}", where)
    raw_keys = body.get("keys")
    if not isinstance(raw_keys, dict):
        raise CorruptCheckpointError(f"{where}: 'keys' must be an object")
    keys = {k: _key_entry(k, v, parts, f"{where}: key '{k}'") for k, v in raw_keys.items()}
    return PagedIndex(
        world_size=_int(body.get("world_size"), "world_size", where, minimum=1),
        checksum_block_bytes=checksum_block(body.get("checksum_block_bytes"), where),
        container=container, keys=keys, parts=dict(parts),
        metadata_xxh3_64=digest, aux_files=aux,
    )


def _key_entry(key: str, d: Any, parts: dict[str, int], at: str) -> KeyEntry:
    if not isinstance(d, dict) or d.get("kind") not in (KIND_TENSOR, KIND_OBJECT) or not isinstance(d.get("pages"), list):
        raise CorruptCheckpointError(f"{at}: entry must have kind and pages, got {d!r}")
    dtype = d.get("dtype")
    if d["kind"] == KIND_TENSOR:
        dtype_from_name(dtype)
    elif dtype is not None:
        raise CorruptCheckpointError(f"{at}: an object has no dtype")
    shape = _int_tuple(d.get("global_shape"), "global_shape", at)
    pages = []
    for p in d["pages"]:
        if not isinstance(p, list) or len(p) != 6 or not isinstance(p[5], str) or len(p[5]) != 16:
            raise CorruptCheckpointError(f"{at}: page entry must be [group, low, high, offset, length, xxh3], got {p!r}")
        page = Page(key, _int(p[0], "group", at), _int_tuple(p[1], "page low", at), _int_tuple(p[2], "page high", at),
                    _int(p[3], "page offset", at), _int(p[4], "page length", at, minimum=1), p[5])
        if page.part_file not in parts or page.offset + page.length > parts[page.part_file]:
            raise CorruptCheckpointError(f"{at}: {page.describe()} lies outside the part files listed")
        if len(page.low) != len(shape) or len(page.high) != len(shape):
            raise CorruptCheckpointError(f"{at}: {page.describe()} has a box of another rank than {shape}")
        pages.append(page)
    return KeyEntry(d["kind"], dtype, shape, tuple(pages))

