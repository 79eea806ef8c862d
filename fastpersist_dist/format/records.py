"""The index: file names, dtype names, shard records, and their validation. Pure.

Both checkpoint formats (see ``checkpoint_formats``) keep one JSON index,
``fastpersist_index.json``, listing every stored record with its file, byte
range and XXH3 block checksums:

* ``raw`` container (the native ``fastpersist`` format, index version 1): each
  ``fastpersist_r<rank>.bin`` holds records back to back, raw elements, no header.
* ``torch_save`` container (the ``torch_dist`` format, index version 2): each
  ``__<rank>_0.distcp`` holds torch DCP items; a tensor record is a whole
  ``torch.save`` archive whose elements start ``data_offset`` bytes in, so the
  checksums cover every byte torch's own reader parses. The index is a sidecar
  of DCP's ``.metadata`` and holds that file's XXH3.

The index is plain JSON (docs/format.md): no pickle is needed to find, read or
verify a tensor. Everything here is pure: no I/O, no ``torch.distributed``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional, Union

import torch

from ..util.errors import CorruptCheckpointError, FastPersistError
from .checksum import ALGORITHM, digest_bytes

BACKEND = "fastpersist"
BACKEND_VERSION = 1
INDEX_FILE = "fastpersist_index.json"
DATA_FILE_RE = re.compile(r"^fastpersist_r(\d{5,})\.bin$")
DCP_FILE_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
STATUS_FILE_RE = re.compile(r"^\.fastpersist_r(\d{5,})\.status\.json$")
KIND_TENSOR = "tensor"
KIND_OBJECT = "object"
CONTAINER_RAW = "raw"
CONTAINER_TORCH_SAVE = "torch_save"
CHECKSUM_BLOCK_ALIGN = 16  # checksum_block_bytes is a multiple of the largest element (see checksum_block)
# Index version per container: what a reader must understand to use the records.
FORMAT_VERSIONS = {CONTAINER_RAW: 1, CONTAINER_TORCH_SAVE: 2}
_FILE_RE = {CONTAINER_RAW: DATA_FILE_RE, CONTAINER_TORCH_SAVE: DCP_FILE_RE}
_AUX_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # a name in the checkpoint directory, no path
COMMON_FILE = "common.pt"  # megatron-core's common state, which every megatron-core up to 0.18 loads from
COMMON_STATE_KEY = "common_state"  # the ShardedObject megatron-core 0.19's save() hands the common state in


def aux_copy_name(name: str) -> str:
    """The committed copy of auxiliary file ``name`` that a later save's megatron ``save()`` cannot overwrite."""
    return f"fastpersist_committed_{name}"

ReplicaId = Union[int, tuple[int, ...]]


def data_file_name(rank: int, container: str = CONTAINER_RAW) -> str:
    """Name of the data file written by ``rank``: ours, or DCP's for the ``torch_save`` container."""
    return f"__{rank}_0.distcp" if container == CONTAINER_TORCH_SAVE else f"fastpersist_r{rank:05d}.bin"


def is_data_file(name: str) -> bool:
    """Whether ``name`` is a data file of either container."""
    return any(regex.match(name) for regex in _FILE_RE.values())


def status_file_name(rank: int) -> str:
    """Name of the per-rank status file handed from the writer to finalize."""
    return f".fastpersist_r{rank:05d}.status.json"


def _dtype_table() -> dict[str, torch.dtype]:
    names = [
        "float64", "float32", "float16", "bfloat16",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
        "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8",
        "bool", "complex64", "complex128",
    ]
    return {n: getattr(torch, n) for n in names if isinstance(getattr(torch, n, None), torch.dtype)}


DTYPE_BY_NAME: dict[str, torch.dtype] = _dtype_table()
NAME_BY_DTYPE: dict[torch.dtype, str] = {v: k for k, v in DTYPE_BY_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Format name of a torch dtype; raises for dtypes the format cannot store."""
    try:
        return NAME_BY_DTYPE[dtype]
    except KeyError:
        raise FastPersistError(
            f"dtype {dtype} is not supported; supported: {sorted(DTYPE_BY_NAME)}"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """Torch dtype of a format dtype name."""
    try:
        return DTYPE_BY_NAME[name]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in index") from None


def itemsize(name: str) -> int:
    """Bytes per element of a format dtype name."""
    return dtype_from_name(name).itemsize


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """1-D uint8 view of the bytes of contiguous ``t``.

    Not ``t.reshape(-1).view(torch.uint8)``: torch calls a tensor of at most one
    element contiguous whatever its stride (a slice of a strided view), keeps
    that stride through ``reshape`` and then refuses the byte view.
    """
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


@dataclass(frozen=True)
class ShardRecord:
    """One stored shard: which part of which global tensor (or object), and where its bytes are.

    ``flattened_range`` (start, stop), when set, says the record holds only those
    elements of the C-order flattening of ``local_shape``. ``offset``/``length``
    span the whole record in its file; the elements start ``data_offset`` bytes
    into it (0 without a container).
    """

    key: str
    kind: str
    dtype: Optional[str]
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    axis_fragmentations: Optional[tuple[int, ...]]
    prepend_axis_num: int
    flattened_range: Optional[tuple[int, int]]
    replica_id: ReplicaId
    file: str
    offset: int
    length: int
    checksums: tuple[str, ...] = field(default=())
    data_offset: int = 0

    @property
    def numel(self) -> int:
        """Elements stored in this record."""
        if self.flattened_range is not None:
            return self.flattened_range[1] - self.flattened_range[0]
        return math.prod(self.local_shape)

    def describe(self) -> str:
        """Short human description used in error messages."""
        return f"'{self.key}' (global offset {self.global_offset}, {self.file} bytes {self.offset}+{self.length})"


@dataclass(frozen=True)
class CheckpointIndex:
    """Everything a reader needs: per-file sizes and every shard record."""

    world_size: int
    checksum_block_bytes: int
    files: dict[str, int]
    records: tuple[ShardRecord, ...]
    container: str = CONTAINER_RAW
    metadata_xxh3_64: Optional[str] = None  # of DCP's .metadata (torch_save container only)
    aux_files: dict[str, str] = field(default_factory=dict)  # name -> XXH3 of files committed beside (common.pt)
    checksum_algorithm: str = ALGORITHM

    @property
    def format_version(self) -> int:
        """Index version, fixed by the container."""
        return FORMAT_VERSIONS[self.container]

    def to_json_bytes(self) -> bytes:
        """Serialize with a checksum over the canonical body, so a flipped bit is caught."""
        body: dict[str, Any] = {
            "format": BACKEND,
            "format_version": self.format_version,
            "world_size": self.world_size,
            "checksum_algorithm": self.checksum_algorithm,
            "checksum_block_bytes": self.checksum_block_bytes,
            "files": dict(sorted(self.files.items())),
            "records": [record_to_json(r, self.container) for r in self.records],
        }
        if self.container != CONTAINER_RAW:  # version 1 indexes stay byte-identical to before
            body["container"] = self.container
            body["metadata_xxh3_64"] = self.metadata_xxh3_64
            body["aux_files"] = dict(sorted(self.aux_files.items()))
        return json.dumps(
            {"body_xxh3_64": digest_bytes(_canonical(body)), "body": body}, indent=1
        ).encode()

    @classmethod
    def from_json_bytes(cls, data: bytes, where: str) -> "CheckpointIndex":
        """Parse and fully validate an index; every problem raises CorruptCheckpointError."""
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(f"{where}: index is not valid JSON: {e}") from None
        body = checked_body(doc, where)
        version = body.get("format_version")
        if version not in FORMAT_VERSIONS.values():
            raise FastPersistError(
                f"{where}: format version {version!r} is not supported by this reader "
                f"(supports {sorted(FORMAT_VERSIONS.values())}); upgrade fastpersist-dist"
            )
        container = body.get("container", CONTAINER_RAW)
        if FORMAT_VERSIONS.get(container) != version:
            raise CorruptCheckpointError(f"{where}: container {container!r} does not go with format version {version}")
        digest, aux = commit_fields(body, container, where)
        block = checksum_block(body.get("checksum_block_bytes"), where)
        files = body.get("files")
        if not isinstance(files, dict):
            raise CorruptCheckpointError(f"{where}: 'files' must be an object")
        for name, size in files.items():
            check_file_name(name, where, container)
            _int(size, f"size of {name}", where)
        raw_records = body.get("records")
        if not isinstance(raw_records, list):
            raise CorruptCheckpointError(f"{where}: 'records' must be a list")
        records = tuple(record_from_json(r, where, files, block, container) for r in raw_records)
        return cls(
            world_size=_int(body.get("world_size"), "world_size", where, minimum=1),
            checksum_block_bytes=block,
            files=dict(files),
            records=records,
            container=container,
            metadata_xxh3_64=digest,
            aux_files=aux,
        )


def checked_body(doc: Any, where: str) -> dict:
    """The body of a parsed index document (any version), once its checksum and format name hold."""
    if not isinstance(doc, dict) or not isinstance(doc.get("body"), dict):
        raise CorruptCheckpointError(f"{where}: index has no 'body' object")
    body = doc["body"]
    if digest_bytes(_canonical(body)) != doc.get("body_xxh3_64"):
        raise CorruptCheckpointError(f"{where}: index checksum mismatch (the index file is damaged)")
    if body.get("format") != BACKEND:
        raise CorruptCheckpointError(f"{where}: not a {BACKEND} index (format={body.get('format')!r})")
    return body


def commit_fields(body: dict, container: str, where: str) -> tuple[Optional[str], dict[str, str]]:
    """The ``.metadata`` digest (``torch_save`` only, else None) and the aux file digests, checked with the algorithm."""
    digest = body.get("metadata_xxh3_64")
    if container == CONTAINER_TORCH_SAVE and not (isinstance(digest, str) and len(digest) == 16):
        raise CorruptCheckpointError(f"{where}: metadata_xxh3_64 must be a 16-digit hex string, got {digest!r}")
    aux = body.get("aux_files", {})
    if not isinstance(aux, dict) or not all(
        isinstance(n, str) and _AUX_FILE_RE.match(n) and isinstance(d, str) and len(d) == 16 for n, d in aux.items()
    ):
        raise CorruptCheckpointError(f"{where}: aux_files must map plain file names to 16-digit hex strings, got {aux!r}")
    if body.get("checksum_algorithm") != ALGORITHM:
        raise CorruptCheckpointError(f"{where}: unknown checksum algorithm {body.get('checksum_algorithm')!r}")
    return (digest if container == CONTAINER_TORCH_SAVE else None), dict(aux)


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def check_file_name(name: Any, where: str, container: str = CONTAINER_RAW) -> None:
    """Only the container's own data file names are accepted: no paths, no '..', no NUL."""
    if not isinstance(name, str) or not _FILE_RE[container].match(name):
        raise CorruptCheckpointError(f"{where}: illegal data file name {name!r}")


_RECORD_FIELDS = tuple(f.name for f in fields(ShardRecord))


def record_to_json(r: ShardRecord, container: str = CONTAINER_RAW) -> dict:
    """JSON object for one record (its tuples dump as lists; no ``data_offset`` without a container).

    Field by field: ``asdict`` deep-copies every tuple, a good part of a small save's commit.
    """
    d = {name: getattr(r, name) for name in _RECORD_FIELDS}
    if container == CONTAINER_RAW:
        del d["data_offset"]
    return d


def checksum_block(value: Any, where: str) -> int:
    """A valid ``checksum_block_bytes``: readers widen reads to whole blocks and take elements from the block
    start, so a block must hold whole elements of every dtype."""
    block = _int(value, "checksum_block_bytes", where, minimum=1)
    if block % CHECKSUM_BLOCK_ALIGN:
        raise CorruptCheckpointError(f"{where}: checksum_block_bytes must be a multiple of {CHECKSUM_BLOCK_ALIGN}, "
                                     f"got {block}")
    return block


def _int(value: Any, what: str, where: str, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum or value >= 2**62:
        raise CorruptCheckpointError(f"{where}: {what} must be an integer >= {minimum}, got {value!r}")
    return value


def _int_tuple(value: Any, what: str, where: str, minimum: int = 0) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > 64:
        raise CorruptCheckpointError(f"{where}: {what} must be a list of integers, got {value!r}")
    return tuple(_int(v, what, where, minimum) for v in value)


def record_from_json(d: Any, where: str, files: dict[str, int], block: int, container: str = CONTAINER_RAW) -> ShardRecord:
    """Validate one record against the format's invariants and the file sizes."""
    if not isinstance(d, dict):
        raise CorruptCheckpointError(f"{where}: record is not an object: {d!r}")
    key = d.get("key")
    if not isinstance(key, str) or not key or "\x00" in key:
        raise CorruptCheckpointError(f"{where}: record key must be a non-empty string without NUL, got {key!r}")
    at = f"{where}: record '{key}'"
    kind = d.get("kind")
    if kind not in (KIND_TENSOR, KIND_OBJECT):
        raise CorruptCheckpointError(f"{at}: unknown kind {kind!r}")
    file = d.get("file")
    check_file_name(file, at, container)
    if file not in files:
        raise CorruptCheckpointError(f"{at}: file {file} is not listed in the index")
    offset = _int(d.get("offset"), "offset", at)
    length = _int(d.get("length"), "length", at)
    data_offset = 0 if container == CONTAINER_RAW else _int(d.get("data_offset"), "data_offset", at)
    if offset + length > files[file]:
        raise CorruptCheckpointError(
            f"{at}: bytes {offset}+{length} lie past the end of {file} ({files[file]} bytes)"
        )
    global_shape = _int_tuple(d.get("global_shape"), "global_shape", at)
    global_offset = _int_tuple(d.get("global_offset"), "global_offset", at)
    local_shape = _int_tuple(d.get("local_shape"), "local_shape", at)
    prepend = _int(d.get("prepend_axis_num"), "prepend_axis_num", at)
    frags = d.get("axis_fragmentations")
    frags = None if frags is None else _int_tuple(frags, "axis_fragmentations", at, minimum=1)
    rid = d.get("replica_id")
    replica_id = _int_tuple(rid, "replica_id", at) if isinstance(rid, list) else _int(rid, "replica_id", at)
    if len(global_shape) != len(global_offset):
        raise CorruptCheckpointError(f"{at}: global_shape and global_offset differ in length")
    fr = d.get("flattened_range")
    flattened_range = None if fr is None else _int_tuple(fr, "flattened_range", at)
    checksums = d.get("checksums")
    if not isinstance(checksums, list) or not all(isinstance(c, str) and len(c) == 16 for c in checksums):
        raise CorruptCheckpointError(f"{at}: checksums must be a list of 16-digit hex strings")
    if len(checksums) != -(-length // block):
        raise CorruptCheckpointError(
            f"{at}: {len(checksums)} checksums for {length} bytes in blocks of {block}"
        )
    dtype = d.get("dtype")
    if kind == KIND_TENSOR:
        size = itemsize(dtype)
        if len(local_shape) + prepend != len(global_shape):
            raise CorruptCheckpointError(f"{at}: local_shape {local_shape} + {prepend} prepended axes != rank of global_shape {global_shape}")
        box = (1,) * prepend + local_shape
        for off, n, g in zip(global_offset, box, global_shape):
            if off + n > g:
                raise CorruptCheckpointError(f"{at}: shard {global_offset}+{box} exceeds global shape {global_shape}")
        numel = math.prod(local_shape)
        if flattened_range is not None:
            if len(flattened_range) != 2 or not flattened_range[0] <= flattened_range[1] <= numel:
                raise CorruptCheckpointError(f"{at}: flattened_range {flattened_range} outside 0..{numel}")
            numel = flattened_range[1] - flattened_range[0]
        if container == CONTAINER_RAW and numel * size != length:
            raise CorruptCheckpointError(
                f"{at}: {numel} elements of {dtype} need {numel * size} bytes, index says {length}"
            )
        if data_offset % size:
            raise CorruptCheckpointError(f"{at}: data_offset {data_offset} does not start a {size}-byte element")
        if data_offset + numel * size > length:
            raise CorruptCheckpointError(
                f"{at}: {numel} elements of {dtype} from byte {data_offset} do not fit in the record's {length} bytes"
            )
    elif dtype is not None or flattened_range is not None or data_offset:
        raise CorruptCheckpointError(f"{at}: object records carry no dtype, flattened_range or data_offset")
    return ShardRecord(
        key=key, kind=kind, dtype=dtype, local_shape=local_shape, global_shape=global_shape,
        global_offset=global_offset, axis_fragmentations=frags, prepend_axis_num=prepend,
        flattened_range=flattened_range, replica_id=replica_id, file=file, offset=offset,
        length=length, checksums=tuple(checksums), data_offset=data_offset,
    )


def with_checksums(record: ShardRecord, checksums: list[str]) -> ShardRecord:
    """The record once its bytes have been streamed and checksummed."""
    return replace(record, checksums=tuple(checksums))
