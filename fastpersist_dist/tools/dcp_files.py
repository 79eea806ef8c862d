"""A torch DCP checkpoint without our index (DCP's own ``FileSystemWriter``): what ``verify`` and ``inspect`` can
say of it without checksums. Its ``.metadata`` (read by DCP's own reader) lists every entry and where each
stored chunk lies; each file it names must hold those bytes."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..format.kinds import DCP_METADATA_FILE
from ..format.records import INDEX_FILE, KIND_OBJECT, KIND_TENSOR, dtype_name

NO_CHECKSUMS = f"torch DCP files without {INDEX_FILE} (written by another DCP writer): no checksums"


class DcpEntry(NamedTuple):
    """One entry of ``.metadata``: a tensor stored in ``chunks`` chunks, or an object."""

    key: str
    kind: str
    dtype: Optional[str]
    global_shape: tuple[int, ...]
    chunks: int
    bytes: int


@dataclass
class DcpFiles:
    """The entries, the files with their sizes, and the problems."""

    entries: list[DcpEntry] = field(default_factory=list)
    files: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def dcp_files(checkpoint_dir: str) -> Optional[DcpFiles]:
    """``checkpoint_dir`` as DCP's ``.metadata`` describes it; None where it has none (or has our index)."""
    if not os.path.exists(os.path.join(checkpoint_dir, DCP_METADATA_FILE)) or \
            os.path.exists(os.path.join(checkpoint_dir, INDEX_FILE)):
        return None
    found = DcpFiles()
    try:
        metadata = FileSystemReader(checkpoint_dir).read_metadata()
    except Exception as e:  # noqa: BLE001 - whatever unpickling a damaged file raises
        found.problems.append(f"{os.path.join(checkpoint_dir, DCP_METADATA_FILE)} is unreadable: {e}")
        return found
    needs: dict[str, int] = {}
    held: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        needs[info.relative_path] = max(needs.get(info.relative_path, 0), info.offset + info.length)
        held[index.fqn] = held.get(index.fqn, 0) + info.length
    for key, item in sorted(metadata.state_dict_metadata.items()):
        if isinstance(item, TensorStorageMetadata):
            found.entries.append(DcpEntry(key, KIND_TENSOR, dtype_name(item.properties.dtype), tuple(item.size),
                                          len(item.chunks), held.get(key, 0)))
        else:
            found.entries.append(DcpEntry(key, KIND_OBJECT, None, (), 1, held.get(key, 0)))
    for name, need in sorted(needs.items()):
        path = os.path.join(checkpoint_dir, name)
        try:
            found.files[name] = os.path.getsize(path)
        except OSError as e:
            found.problems.append(f"{path} named in {DCP_METADATA_FILE} is unreadable: {e}")
            continue
        if found.files[name] < need:
            found.problems.append(f"{path} has {found.files[name]} bytes; {DCP_METADATA_FILE} places chunks up to "
                                  f"byte {need}")
    return found
