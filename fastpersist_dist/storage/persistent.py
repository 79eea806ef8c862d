"""The persistent tier: a directory every node sees, or an ``msc://PROFILE/PATH`` object-store prefix, behind one
small interface whose operations are whole or nothing (small files, checked data files, listings, removals).
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import time
from functools import partial
from typing import Any, Optional

from ..util.beside import Beside, all_results, pools_refuse_work
from ..util.errors import CorruptCheckpointError, FastPersistError
from .checked_read import CheckedFile, check_file
from .copy import copy_checked, receive_checked
from .spans import Span, chunk_plan
from .files import atomic_write, unlink_quietly

logger = logging.getLogger(__name__)

MSC_SCHEME = "msc://"
FETCH_AHEAD = 4  # ranged reads of an object in flight at once: one stream rarely fills an object store's bandwidth


class PersistentDir:
    """One directory of the persistent tier; see the module. ``url`` is the path or URL as given."""

    url: str

    def read(self, name: str) -> Optional[bytes]:
        """The whole file ``name``, None where there is none."""
        raise NotImplementedError

    def write(self, name: str, data: bytes) -> None:
        """Write ``name`` so that readers see the old file or the whole new one."""
        raise NotImplementedError

    def remove(self, name: str) -> None:
        """Remove ``name`` if it is there."""
        raise NotImplementedError

    def remove_all(self, names: list[str]) -> None:
        """Remove those of ``names`` that are there."""
        for name in names:
            self.remove(name)

    def names(self) -> list[str]:
        """The files directly in this directory."""
        raise NotImplementedError

    def remove_tree(self, first: frozenset[str] = frozenset()) -> None:
        """Remove this directory and everything in it (nothing where it is not there): the files named in ``first``
        (commit markers), wherever they lie in it, before any other, so that a removal cut short leaves nothing
        that passes for a whole checkpoint. Raises ``ValueError`` where this is no checkpoint's directory."""
        raise NotImplementedError

    def put(self, name: str, src: str, spans: list[Span], size: int, who: str) -> float:
        """Copy the local data file ``src`` here as ``name``, every block checked; the seconds it took."""
        raise NotImplementedError

    def fetch(self, name: str, dst: str, spans: list[Span], size: int, who: str) -> float:
        """Copy data file ``name`` from here to the local path ``dst``, every block checked; the seconds it took."""
        raise NotImplementedError

    def sub(self, name: str) -> "PersistentDir":
        """The directory ``name`` inside this one."""
        raise NotImplementedError

    def siblings(self) -> list["PersistentDir"]:
        """The other directories beside this one (other checkpoints of the same run)."""
        raise NotImplementedError

    @property
    def local_path(self) -> Optional[str]:
        """This directory as a local path readers can open (a filesystem), None for an object store."""
        return None

    def where(self, name: str) -> str:
        """``name`` in this directory, for messages."""
        return f"{self.url.rstrip('/')}/{name}"


class PosixDir(PersistentDir):
    """A directory on a filesystem every node mounts."""

    def __init__(self, path: str):
        self.url = path

    @property
    def local_path(self) -> Optional[str]:
        return self.url

    def read(self, name: str) -> Optional[bytes]:
        try:
            with open(os.path.join(self.url, name), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise FastPersistError(f"cannot read {self.where(name)}: {e}") from e

    def write(self, name: str, data: bytes) -> None:
        os.makedirs(self.url, exist_ok=True)
        atomic_write(os.path.join(self.url, name), data)

    def remove(self, name: str) -> None:
        unlink_quietly(os.path.join(self.url, name))

    def names(self) -> list[str]:
        try:
            return [n for n in os.listdir(self.url) if os.path.isfile(os.path.join(self.url, n))]
        except FileNotFoundError:
            return []

    def remove_tree(self, first: frozenset[str] = frozenset()) -> None:
        if not os.path.lexists(self.url):
            return
        if os.path.islink(self.url) or not os.path.isdir(self.url) or os.path.realpath(self.url) == "/":
            raise ValueError(f"{self.url} is not a checkpoint's directory: not removed")
        try:
            for parent, _, files in os.walk(self.url):
                for name in first.intersection(files):
                    os.unlink(os.path.join(parent, name))
            shutil.rmtree(self.url)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise FastPersistError(f"removing {self.url} failed: {e}") from e

    def put(self, name: str, src: str, spans: list[Span], size: int, who: str) -> float:
        return copy_checked(src, os.path.join(self.url, name), spans, size, who, reserve=True)

    def fetch(self, name: str, dst: str, spans: list[Span], size: int, who: str) -> float:
        return copy_checked(os.path.join(self.url, name), dst, spans, size, who)

    def sub(self, name: str) -> "PersistentDir":
        return PosixDir(os.path.join(self.url, name))

    def siblings(self) -> list["PersistentDir"]:
        here = os.path.abspath(self.url)
        parent = os.path.dirname(here)
        try:
            names = sorted(os.listdir(parent))
        except OSError:
            return []
        return [PosixDir(os.path.join(parent, n)) for n in names
                if os.path.join(parent, n) != here and os.path.isdir(os.path.join(parent, n))]


class MscDir(PersistentDir):
    """A prefix in an object store, through multi-storage-client (``msc://PROFILE/PATH``; ``MSC_CONFIG``)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        try:
            import multistorageclient as msc
        except ImportError as e:
            raise FastPersistError(f"{url}: msc:// checkpoints need multi-storage-client (pip install "
                                   "'multi-storage-client[boto3]'), which is not installed") from e
        try:
            self._client, path = msc.resolve_storage_client(self.url)
        except Exception as e:  # noqa: BLE001 - msc raises what its configuration parser raises
            raise FastPersistError(f"{url}: multi-storage-client cannot resolve it ({type(e).__name__}: {e}); is "
                                   "its profile in the file MSC_CONFIG names?") from e
        self._prefix = path.strip("/")
        self._uploads_paths = _rust_client_enabled(self._client)

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{name}" if self._prefix else name

    def _call(self, what: str, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            raise
        except Exception as e:  # noqa: BLE001 - botocore's and msc's errors alike: named, with the object
            damage = _damage(e)
            if damage is not None:  # a damaged source block is not a failure to reach the store: not retried
                raise damage from None
            raise FastPersistError(f"{what} {self.where(name)} failed: {type(e).__name__}: {e}") from e

    def read(self, name: str) -> Optional[bytes]:
        try:
            return bytes(self._call("reading", name, self._client.read, self._key(name)))
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes) -> None:
        self._call("writing", name, self._client.write, self._key(name), data)  # one PUT: whole or absent

    def remove(self, name: str) -> None:
        try:
            self._call("removing", name, self._client.delete, self._key(name))
        except FileNotFoundError:
            pass

    def remove_all(self, names: list[str]) -> None:
        """A request per thousand names (S3's DeleteObjects), where removing them one by one takes two requests
        each (msc asks for the object's metadata first): at thousands of ranks, thousands of drain markers."""
        if names:
            self._call(f"removing {len(names)} files ({names[0]}, ...) from", "", self._client.delete_many,
                       [self._key(n) for n in names])

    def names(self) -> list[str]:
        head = f"{self._prefix}/" if self._prefix else ""
        found = self._call("listing", "", lambda: [o.key for o in self._client.list(head)])
        return [k[len(head):] for k in found if k.startswith(head) and "/" not in k[len(head):]]

    def remove_tree(self, first: frozenset[str] = frozenset()) -> None:
        if not self._prefix:
            raise ValueError(f"{self.url} is a whole store, not a checkpoint's prefix: not removed")
        head = f"{self._prefix}/"
        keys = self._call("listing", "", lambda: [o.key for o in self._client.list(head) if o.key.startswith(head)])
        markers = [k for k in keys if k.rpartition("/")[2] in first]
        for batch in (markers, [k for k in keys if k.rpartition("/")[2] not in first]):
            if batch:
                self._call(f"removing {len(batch)} files ({batch[0]}, ...) under", "", self._client.delete_many, batch)

    def put(self, name: str, src: str, spans: list[Span], size: int, who: str) -> float:
        """Boto3 uploads a :class:`CheckedFile`, read in Python threads. Where the profile enables msc's Rust
        client, which uploads a file given by its path outside this interpreter (about half the CPU, the two
        checks included), it reads ``src`` itself: ``src`` is checked whole before and after, so the bytes it
        read are those checked, and a failed check after removes the object. While the process exits, boto3
        cannot send a file above msc's multipart threshold (its parts go from a thread pool of its own, which
        an exiting interpreter refuses): ``src`` is then sent in one PUT from a mapping of it, checked the same
        way (S3 takes up to 5 GiB in one PUT)."""
        start = time.perf_counter()
        if self._uploads_paths or pools_refuse_work():
            self._put_whole(name, src, spans, size, who)
        else:
            try:
                with CheckedFile(src, spans, size, who) as f:
                    self._call("uploading to", name, self._client.upload_file, self._key(name), f)
            except CorruptCheckpointError:  # a damaged block: never sent again
                raise
            except FastPersistError:
                if not pools_refuse_work():
                    raise
                # The process began to exit during the upload, and boto3's pool refused the next part.
                logger.debug("%s: the process exits: %s goes to %s again, in one PUT", who, src, self.where(name))
                self._put_whole(name, src, spans, size, who)
        stored = self._call("checking", name, self._client.info, self._key(name)).content_length
        if stored != size:
            raise FastPersistError(f"{who}: {self.where(name)} holds {stored} bytes after its upload, {src} has "
                                   f"{size}")
        return time.perf_counter() - start

    def _put_whole(self, name: str, src: str, spans: list[Span], size: int, who: str) -> None:
        """``src`` sent whole, not read through a :class:`CheckedFile`: by msc's Rust client from its path, or in
        one PUT from a mapping of it; checked whole before and after, the object removed where the check after
        fails."""
        check_file(src, spans, size, who)
        if self._uploads_paths:
            self._call("uploading to", name, self._client.upload_file, self._key(name), src)
        else:
            logger.debug("%s: the process exits: %s goes to %s in one PUT", who, src, self.where(name))
            self._put_mapped(name, src, size)
        try:
            check_file(src, spans, size, who)
        except CorruptCheckpointError:
            try:
                self.remove(name)
            except FastPersistError as e:  # the drain fails either way: no index will name the object
                logger.warning("%s: cannot remove %s, uploaded from a damaged file (%s): the next save into "
                               "%s replaces or removes it", who, self.where(name), e, self.url)
            raise

    def _put_mapped(self, name: str, src: str, size: int) -> None:
        """``src`` (``size`` bytes) to ``name`` in one PUT, read by the client from a read-only mapping of it."""
        if not size:
            self.write(name, b"")
            return
        with open(src, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mapped:
            self._call("uploading to", name, self._client.write, self._key(name), mapped)

    def fetch(self, name: str, dst: str, spans: list[Span], size: int, who: str) -> float:
        from multistorageclient.types import Range

        def chunk_bytes(chunk: list[Span]) -> bytes:
            offset, length = chunk[0].start, chunk[-1].end - chunk[0].start
            return self._call("reading", name, self._client.read, self._key(name),
                              byte_range=Range(offset=offset, size=length))

        try:
            return receive_checked(chunk_plan(spans), chunk_bytes, dst, self.where(name), who, FETCH_AHEAD)
        except FileNotFoundError:
            raise FastPersistError(f"{who}: {self.where(name)} is missing") from None

    def sub(self, name: str) -> "PersistentDir":
        return MscDir(f"{self.url}/{name}")

    def siblings(self) -> list["PersistentDir"]:
        parent, _, _ = self.url.rpartition("/")
        sub = self._prefix.rpartition("/")[0]
        listed = self._call("listing", "..", lambda: list(self._client.list(f"{sub}/" if sub else "",
                                                                                include_directories=True)))
        dirs = sorted(o.key.rstrip("/").rpartition("/")[2] for o in listed if o.type == "directory")
        here = self._prefix.rpartition("/")[2]
        return [MscDir(f"{parent}/{d}") for d in dirs if d != here]


def _damage(error: Optional[BaseException]) -> Optional[CorruptCheckpointError]:
    """The ``CorruptCheckpointError`` among the causes of a client's ``error``: a :class:`CheckedFile` raises it
    in the client's reading thread, and the client wraps it in errors of its own."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, CorruptCheckpointError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _rust_client_enabled(client: Any) -> bool:
    """Whether the msc ``client``'s profile enables its Rust client (``rust_client`` in the provider's options),
    which serves uploads of a file given by its path only."""
    try:
        return bool(client._is_rust_client_enabled())
    except Exception:  # noqa: BLE001 - an msc without that query: its Python client serves every upload
        return False


def write_at_once(writes: list[tuple[PersistentDir, str, bytes]]) -> None:
    """``dir.write(name, data)`` for each of ``writes``, all sent at once: to an object store each is a request
    of its own, and a caller waits one round trip for them instead of one per file. Raises the first failure
    after every write ended."""
    if len(writes) < 2:
        for where, name, data in writes:
            where.write(name, data)
        return
    all_results([Beside(partial(where.write, name, data), f"fastpersist-put-{i}")
                 for i, (where, name, data) in enumerate(writes)])


def checkpoint_url(checkpoint_dir: Any) -> str:
    """``checkpoint_dir`` (a str or a Path) as a string: ``msc://`` URLs kept whole (a Path makes them ``msc:/``),
    paths made absolute (a checkpoint's local copies are found by its path, whatever the process's directory)."""
    path = str(checkpoint_dir)
    if path.startswith("msc:/"):
        return path if path.startswith(MSC_SCHEME) else MSC_SCHEME + path[len("msc:/"):]
    return os.path.abspath(path)


def persistent_dir(checkpoint_dir: str) -> PersistentDir:
    """The persistent tier at ``checkpoint_dir``: an object-store prefix for ``msc://`` URLs, else a directory."""
    path = checkpoint_url(checkpoint_dir)
    return MscDir(path) if path.startswith(MSC_SCHEME) else PosixDir(path)


def is_object_store(checkpoint_dir: str) -> bool:
    return checkpoint_url(checkpoint_dir).startswith(MSC_SCHEME)
