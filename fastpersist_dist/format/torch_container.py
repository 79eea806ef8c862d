"""The ``torch.save`` container around one tensor's raw bytes, built without touching the bytes. Pure.

torch's DCP ``FileSystemReader`` (and so megatron's ``torch_dist`` loader)
reads every tensor item of a ``.distcp`` file with ``torch.load``: the item is
a ``torch.save`` zip archive holding a small pickle (``archive/data.pkl``), a
few marker records and the elements (``archive/data/0``, stored uncompressed,
64-byte aligned). The archive around the elements depends only on dtype,
shape and byte count, so it is made here as two byte strings, a *prefix*
(everything before the elements) and a *suffix* (the records after them and
the zip central directory), and the writer streams prefix, elements, suffix.

The archive matches ``torch.save`` with ``torch.utils.serialization.config.
save.compute_crc32 = False`` (tests/test_torch_container.py compares them):
zip CRC fields are 0, which torch's reader ignores; integrity comes from our
own XXH3 block checksums instead (CRC-32 runs at a seventh of XXH3's speed
here). Records are zip64-described where they need it (over 4 GiB).
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import struct
from dataclasses import dataclass
from functools import lru_cache

import torch

from .layout import c_strides

ALIGNMENT = 64  # torch's default storage alignment, written as '.storage_alignment'
_ARCHIVE = "archive"
_ZIP64 = 0xFFFFFFFF
_UTF8_NAMES = 0x0800
_DESCRIPTOR = 0x0008  # sizes follow the data; miniz sets it for every record but an empty one
# torch writes a 40-digit id per archive; its reader does not interpret it.
_SERIALIZATION_ID = b"0" * 40


@dataclass(frozen=True)
class Container:
    """The bytes of a ``torch.save`` archive before and after a tensor's elements."""

    prefix: bytes
    suffix: bytes

    def length(self, nbytes: int) -> int:
        """Bytes of the whole archive around ``nbytes`` of elements."""
        return len(self.prefix) + nbytes + len(self.suffix)


class _StorageRef:
    """Stands in for the tensor's storage in the pickle; persisted by reference, like torch does."""

    def __init__(self, dtype: torch.dtype, nbytes: int):
        self.dtype, self.nbytes = dtype, nbytes


class _TensorStub:
    """Pickles exactly as ``torch.Tensor.__reduce_ex__`` does for a contiguous CPU tensor."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int):
        self.dtype, self.shape, self.nbytes = dtype, shape, nbytes

    def __reduce_ex__(self, protocol: int) -> tuple:
        storage = _StorageRef(self.dtype, self.nbytes)
        args = (storage, 0, self.shape, c_strides(self.shape), False, collections.OrderedDict())
        if _legacy_storage_type(self.dtype) is not None:
            return torch._utils._rebuild_tensor_v2, args
        return torch._utils._rebuild_tensor_v3, (*args, self.dtype)


def _legacy_storage_type(dtype: torch.dtype) -> type | None:
    """torch's legacy typed storage class for ``dtype`` (e.g. FloatStorage); None for newer dtypes."""
    name = torch.storage._dtype_to_storage_type_map().get(dtype)
    return getattr(torch, name, None) if name else None


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: object) -> object:
        if not isinstance(obj, _StorageRef):
            return None
        legacy = _legacy_storage_type(obj.dtype)
        if legacy is None:  # torch saves these as an untyped storage counted in bytes
            return ("storage", torch.storage.UntypedStorage, "0", "cpu", obj.nbytes)
        return ("storage", legacy, "0", "cpu", obj.nbytes // obj.dtype.itemsize)


def tensor_pickle(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """``archive/data.pkl`` of a contiguous CPU tensor of ``dtype`` and ``shape``."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(_TensorStub(dtype, tuple(shape), math.prod(shape) * dtype.itemsize))
    return buf.getvalue()


def _local_header(name: bytes, offset: int, size: int) -> bytes:
    """Local file header whose data starts at the next ``ALIGNMENT`` boundary (padding in an 'FB' extra field).

    As torch (miniz) writes it: sizes and CRC follow a non-empty record's data in a descriptor.
    """
    zip64 = struct.pack("<HHQQ", 1, 16, 0, 0) if size >= _ZIP64 else b""
    fixed = 30 + len(name) + len(zip64)
    pad = -(offset + fixed + 4) % ALIGNMENT  # the padding field's own 4-byte header counts too
    extra = zip64 + struct.pack("<HH", 0x4246, pad) + b"Z" * pad
    return struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, _flags(size), 0, 0, 0, 0, 0, 0, len(name), len(extra)) \
        + name + extra


def _flags(size: int) -> int:
    return _UTF8_NAMES | (_DESCRIPTOR if size else 0)


def _data_descriptor(size: int) -> bytes:
    if not size:
        return b""
    if size >= _ZIP64:
        return struct.pack("<IIQQ", 0x08074B50, 0, size, size)
    return struct.pack("<IIII", 0x08074B50, 0, size, size)


def _central_header(name: bytes, offset: int, size: int) -> bytes:
    fields, zip64 = [], b""
    if size >= _ZIP64:
        fields += [size, size]
    if offset >= _ZIP64:
        fields.append(offset)
    if fields:
        zip64 = struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields)
    short_size = _ZIP64 if size >= _ZIP64 else size
    short_offset = _ZIP64 if offset >= _ZIP64 else offset
    return struct.pack(
        "<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, _flags(size), 0, 0, 0, 0, short_size, short_size, len(name),
        len(zip64), 0, 0, 0, 0, short_offset,
    ) + name + zip64


def _end_records(entries: int, cd_offset: int, cd_size: int) -> bytes:
    """zip64 end of central directory, its locator, and the classic end record (torch writes all three)."""
    eocd64_offset = cd_offset + cd_size
    eocd64 = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 45, 0, 0, entries, entries, cd_size, cd_offset)
    locator = struct.pack("<IIQI", 0x07064B50, 0, eocd64_offset, 1)
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(entries, 0xFFFF), min(entries, 0xFFFF),
                       min(cd_size, _ZIP64), min(cd_offset, _ZIP64), 0)
    return eocd64 + locator + eocd


@lru_cache(maxsize=4096)
def tensor_container(dtype: torch.dtype, shape: tuple[int, ...]) -> Container:
    """The archive around the C-order elements of a ``dtype`` tensor of ``shape``.

    Cached: a model has few distinct (dtype, shape) pairs per rank.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    records = [
        ("data.pkl", tensor_pickle(dtype, shape)),
        (".format_version", b"1"),
        (".storage_alignment", str(ALIGNMENT).encode()),
        ("byteorder", b"little"),
        ("data/0", None),  # the elements, streamed by the caller
        ("version", b"3\n"),
        (".data/serialization_id", _SERIALIZATION_ID),
    ]
    parts: list[bytes] = []
    central: list[bytes] = []
    prefix = b""
    offset = 0
    for name, payload in records:
        full = f"{_ARCHIVE}/{name}".encode()
        size = nbytes if payload is None else len(payload)
        header = _local_header(full, offset, size)
        central.append(_central_header(full, offset, size))
        parts.append(header)
        if payload is None:
            prefix, parts = b"".join(parts), []
        else:
            parts.append(payload)
        parts.append(_data_descriptor(size))
        offset += len(header) + size + len(parts[-1])
    cd = b"".join(central)
    suffix = b"".join(parts) + cd + _end_records(len(records), offset, len(cd))
    return Container(prefix, suffix)
