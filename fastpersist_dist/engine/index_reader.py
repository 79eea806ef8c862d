"""Reading a committed checkpoint's index, and checking the files committed beside it.

Used by the load engine, ``verify`` and ``inspect``, and by the commit itself
(rank 0 reads the groups' part files back to build DCP's ``.metadata``).
"""

from __future__ import annotations

import json
import os
from typing import Optional, Union

from ..format.index_pages import Box, Page, PagedIndex, is_paged, parse_top, select_pages
from ..format.kinds import DCP_METADATA_FILE
from ..format.records import CONTAINER_TORCH_SAVE, INDEX_FILE, CheckpointIndex, aux_copy_name
from ..storage.files import file_digest
from ..util.errors import CorruptCheckpointError, FastPersistError, IncompleteCheckpointError


def read_top(checkpoint_dir: str, who: str) -> Union[PagedIndex, CheckpointIndex]:
    """The committed top level (version 3) or whole index (versions 1 and 2), or why there is none.

    ``who`` (e.g. "rank 3") starts every message.
    """
    path = os.path.join(str(checkpoint_dir), INDEX_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{who}: {checkpoint_dir} has no {INDEX_FILE}: this checkpoint is incomplete "
            "(its save crashed, failed or is still running) and cannot be loaded"
        ) from None
    except OSError as e:
        raise FastPersistError(f"{who}: cannot read {path}: {e}") from e
    return parse_top_bytes(data, path, who)


def parse_top_bytes(data: bytes, where: str, who: str) -> Union[PagedIndex, CheckpointIndex]:
    """The top level (or whole index) from the bytes of an ``INDEX_FILE`` read from ``where``."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        doc = None  # from_json_bytes says what is wrong
    return parse_top(doc, f"{who}: {where}") if is_paged(doc) else CheckpointIndex.from_json_bytes(data, where)


def read_index(checkpoint_dir: str, who: str, wants: Optional[dict[str, list[Box]]] = None) -> CheckpointIndex:
    """The committed index, or an error saying why this directory cannot be loaded.

    For a version-3 (paged) index, ``wants`` (key -> requested boxes) reads only
    the pages meeting them; None reads every page. Versions 1 and 2 are one
    file, always read whole.
    """
    index = read_unchecked_index(checkpoint_dir, who, wants)
    check_markers(str(checkpoint_dir), index, who)
    return index


def read_unchecked_index(checkpoint_dir: str, who: str,
                         wants: Optional[dict[str, list[Box]]] = None) -> CheckpointIndex:
    """``read_index`` without checking the files committed beside it: for reports that list those too."""
    return read_top_and_records(checkpoint_dir, who, wants)[1]


def read_top_and_records(checkpoint_dir: str, who: str, wants: Optional[dict[str, list[Box]]] = None
                         ) -> tuple[Union[PagedIndex, CheckpointIndex], CheckpointIndex]:
    """The committed top level (or whole index) as read, and the records of the pages ``wants`` meets (None:
    all); unchecked, as :func:`read_unchecked_index`. For a rewrite of the top level (``engine/remove.py``)."""
    top = read_top(checkpoint_dir, who)
    if not isinstance(top, PagedIndex):
        return top, top
    pages = top.pages if wants is None else select_pages(top, wants)
    return top, top.whole(read_page_bytes(str(checkpoint_dir), top, pages, who), f"{who}: {checkpoint_dir}")


def check_markers(checkpoint_dir: str, index: Union[CheckpointIndex, PagedIndex], who: str) -> None:
    """The index goes with the files committed beside it: its own ``.metadata`` (or none for the native
    format), then auxiliary files (``common.pt``); a marker from another writer is the first thing to tell."""
    if index.container == CONTAINER_TORCH_SAVE:
        _check_dcp_metadata(checkpoint_dir, index, who)
    elif os.path.lexists(os.path.join(checkpoint_dir, DCP_METADATA_FILE)):
        # Our saves remove both markers first, so this .metadata came later, from another writer.
        raise CorruptCheckpointError(
            f"{who}: {checkpoint_dir} holds a native {INDEX_FILE} and a torch DCP {DCP_METADATA_FILE} written "
            "after it by another writer (e.g. megatron's own torch_dist save into the same directory): which "
            f"checkpoint is meant is unknown; remove {INDEX_FILE} to load the torch_dist one"
        )
    _check_aux_files(checkpoint_dir, index, who)


def read_page_bytes(checkpoint_dir: str, top: PagedIndex, pages: list[Page], who: str) -> list[tuple[Page, bytes]]:
    """The bytes of ``pages``, read from their part files (checked and parsed by ``PagedIndex.whole``)."""
    by_file: dict[str, list[Page]] = {}
    for page in pages:
        by_file.setdefault(page.part_file, []).append(page)
    read: list[tuple[Page, bytes]] = []
    for name, file_pages in sorted(by_file.items()):
        path = os.path.join(checkpoint_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{who}: index part file {path} listed in {INDEX_FILE} is missing "
                f"(it holds the records of '{file_pages[0].key}'): this checkpoint is damaged"
            ) from None
        except OSError as e:
            raise FastPersistError(f"{who}: cannot read {path}: {e}") from e
        try:
            size = os.fstat(fd).st_size
            if size != top.parts[name]:
                raise CorruptCheckpointError(f"{who}: index part file {path} has {size} bytes, "
                                             f"{INDEX_FILE} says {top.parts[name]}: it is damaged")
            read.extend((p, os.pread(fd, p.length, p.offset)) for p in sorted(file_pages, key=lambda p: p.offset))
        finally:
            os.close(fd)
    return read


def _check_aux_files(checkpoint_dir: str, index: Union[CheckpointIndex, PagedIndex], who: str) -> None:
    """Every auxiliary file is the one committed: megatron-core <= 0.18 loads ``common.pt`` before any strategy."""
    for name, want in sorted(index.aux_files.items()):
        path = os.path.join(checkpoint_dir, name)
        found = file_digest(path, who)
        if found == want:
            continue
        copy = aux_copy_name(name)
        fix = (f"; its committed copy {copy} is intact: copy it over {name} to load this checkpoint"
               if index.aux_files.get(copy) == want and file_digest(os.path.join(checkpoint_dir, copy), who) == want
               else "")
        state = "is missing" if found is None else f"(XXH3 {found}) is not the one committed with {INDEX_FILE} (XXH3 {want})"
        raise CorruptCheckpointError(
            f"{who}: {path} {state}: it was damaged or rewritten after the commit (megatron-core <= 0.18's "
            f"save() writes {name} before the sharded strategy runs, so a save into this directory that was "
            f"killed before that leaves its own {name} behind){fix}"
        )


def _check_dcp_metadata(checkpoint_dir: str, index: Union[CheckpointIndex, PagedIndex], who: str) -> None:
    """The sidecar index holds only if DCP's ``.metadata`` is the one committed with it."""
    path = os.path.join(checkpoint_dir, DCP_METADATA_FILE)
    digest = file_digest(path, who)
    if digest is None:
        raise IncompleteCheckpointError(
            f"{who}: {checkpoint_dir} has no {DCP_METADATA_FILE}: this torch_dist checkpoint is incomplete "
            "(its save crashed, failed or is still running) and cannot be loaded"
        )
    if digest != index.metadata_xxh3_64:
        raise CorruptCheckpointError(
            f"{who}: {path} (XXH3 {digest}) is not the one committed with {INDEX_FILE} "
            f"(XXH3 {index.metadata_xxh3_64}): it is damaged, or another writer (e.g. megatron's own torch_dist) "
            f"rewrote this checkpoint; to load such a checkpoint without our checksums, remove {INDEX_FILE}"
        )
