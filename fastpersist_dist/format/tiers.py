"""Where a tiered checkpoint's copies are, and how far it got: the tiers manifest. Pure.

A tiered save (``FastPersistSaveStrategy(local_dir=...)``) writes each rank's
data file into the local tier of the rank's node (``local_dir``, the same path
on every node, each node's own storage), commits the index into every node's
copy, then copies the data to the persistent tier (the ``checkpoint_dir`` given
to ``save()``) in the background and commits the index there last.

``fastpersist_tiers.json`` says which checkpoint a directory holds (a fresh
``checkpoint_id`` per save: a local copy is used only for the checkpoint of
that id), where its copies are, and, in the persistent directory, its state:

* ``local``: every rank's data file is on its node's local tier, the index in
  every node's copy and, not committed, in the persistent directory's
  ``PENDING_DIR`` (loadable from the local tiers, by any node);
* ``replicated``: each node's data files are also in the local tiers of the
  ``replicas`` other nodes its manifest names (any one node may be lost);
* ``durable``: every data file copied to the persistent tier and checked
  against its checksums, the index committed there last.

``created`` is when the checkpoint became ``local``; ``reached`` when each
later state was recorded (wall clock), so that how long replication and the
drain took can be read afterwards.

A checkpoint saved ``persistent=False`` (local only) stays ``local``.

Like the index, the manifest is canonical JSON with an XXH3 of its body.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any

from ..util.errors import CorruptCheckpointError
from .checksum import digest_bytes
from .kinds import MARKERS
from .records import _canonical

TIERS_FILE = "fastpersist_tiers.json"
TIERED_MARKERS = (TIERS_FILE, *MARKERS)  # what makes a persistent directory a (tiered) checkpoint
PENDING_DIR = ".fastpersist_pending"  # the index of a checkpoint not durable yet, in the persistent directory
DRAINED_PREFIX = ".fastpersist_drained."  # the persistent tier's marker of a data file copied and checked
LOCAL = "local"
REPLICATED = "replicated"
DURABLE = "durable"
STATES = (LOCAL, REPLICATED, DURABLE)
_NAME_RE = re.compile(r"[^A-Za-z0-9_.-]")


def local_copy_dir(local_dir: str, checkpoint_dir: str) -> str:
    """The directory of ``checkpoint_dir``'s copy in the local tier ``local_dir``: its last path component and a
    digest of its whole path (two runs' ``iter_0000100`` stay apart)."""
    path = checkpoint_dir.rstrip("/") or "/"
    base = _NAME_RE.sub("_", path.rsplit("/", 1)[-1]) or "root"
    return os.path.join(local_dir, f"{base}-{digest_bytes(path.encode())[:12]}")


@dataclass(frozen=True)
class TierManifest:
    """One tiered checkpoint: its id, its homes, which node holds which data file, its state."""

    checkpoint_id: str
    checkpoint_dir: str  # the persistent home, as given to save()
    local_dir: str  # the local tier's root on every node
    nodes: tuple[tuple[int, ...], ...]  # node -> its ranks (global ranks, ascending)
    files: dict[str, int]  # data file -> the rank that wrote it
    index_files: tuple[str, ...]  # the committed index files, in commit order (the marker last)
    index_xxh3_64: str  # of the committed top-level index: ties the manifest to its index
    state: str
    created: float  # unix time of the local commit
    persistent: bool = True  # False: a local checkpoint only, never copied to the persistent tier
    replica_nodes: tuple[tuple[int, ...], ...] = ()  # node -> the other nodes that hold its data files too
    reached: dict[str, float] = field(default_factory=dict)  # a state after local -> unix time it was recorded

    def holders(self, data_file: str) -> tuple[int, ...]:
        """The nodes whose local tier holds ``data_file``: its rank's, then its replicas'."""
        node = self.node_of(self.files[data_file])
        return (node, *(self.replica_nodes[node] if self.replica_nodes else ()))

    @property
    def world_size(self) -> int:
        return sum(len(ranks) for ranks in self.nodes)

    def node_of(self, rank: int) -> int:
        """The node that ``rank`` ran on."""
        return next(n for n, ranks in enumerate(self.nodes) if rank in ranks)

    def files_of_node(self, node: int) -> list[str]:
        """The data files the ranks of ``node`` wrote."""
        return sorted(f for f, r in self.files.items() if r in self.nodes[node])

    def files_kept_on(self, node: int) -> list[str]:
        """The data files ``node``'s local tier holds: its ranks' and the replicas it keeps for other nodes."""
        return sorted(f for f in self.files if node in self.holders(f))

    def with_state(self, state: str, at: float) -> "TierManifest":
        """This manifest in ``state``, reached at unix time ``at``."""
        return replace(self, state=state, reached={**self.reached, state: at})

    def to_json_bytes(self) -> bytes:
        body = {
            "checkpoint_id": self.checkpoint_id, "checkpoint_dir": self.checkpoint_dir, "local_dir": self.local_dir,
            "nodes": [list(r) for r in self.nodes], "files": dict(sorted(self.files.items())),
            "index_files": list(self.index_files), "index_xxh3_64": self.index_xxh3_64, "state": self.state,
            "created": self.created, "persistent": self.persistent,
            "replica_nodes": [list(r) for r in self.replica_nodes], "reached": dict(sorted(self.reached.items())),
        }
        return json.dumps({"body": body, "body_xxh3_64": digest_bytes(_canonical(body))}, indent=1).encode()

    @classmethod
    def from_json_bytes(cls, data: bytes, where: str) -> "TierManifest":
        """Parse and check a manifest; every problem raises ``CorruptCheckpointError`` naming ``where``."""
        try:
            doc = json.loads(data)
            body = doc["body"]
            canonical = _canonical(body)
        except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"{where}: not a tiers manifest ({type(e).__name__}: {e})") from None
        if digest_bytes(canonical) != doc.get("body_xxh3_64"):
            raise CorruptCheckpointError(f"{where}: tiers manifest checksum mismatch (the file is damaged)")
        try:
            manifest = cls(
                checkpoint_id=_text(body["checkpoint_id"]), checkpoint_dir=_text(body["checkpoint_dir"]),
                local_dir=_text(body["local_dir"]), nodes=tuple(tuple(int(r) for r in n) for n in body["nodes"]),
                files={_text(f): int(r) for f, r in body["files"].items()},
                index_files=tuple(_text(n) for n in body["index_files"]),
                index_xxh3_64=_text(body["index_xxh3_64"]), state=_text(body["state"]),
                created=float(body["created"]), persistent=bool(body["persistent"]),
                replica_nodes=tuple(tuple(int(n) for n in r) for r in body["replica_nodes"]),
                # a manifest written before the times were recorded has none
                reached={_text(s): float(t) for s, t in body.get("reached", {}).items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptCheckpointError(f"{where}: tiers manifest field missing or malformed: {e}") from None
        _check(manifest, where)
        return manifest


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _check(m: TierManifest, where: str) -> None:
    ranks = sorted(r for node in m.nodes for r in node)
    if ranks != list(range(len(ranks))):
        raise CorruptCheckpointError(f"{where}: the nodes' ranks {ranks} are not 0..N-1 once each")
    if m.state not in STATES:
        raise CorruptCheckpointError(f"{where}: unknown state {m.state!r} (known: {', '.join(STATES)})")
    if not set(m.reached) <= set(STATES[1:STATES.index(m.state) + 1]):
        raise CorruptCheckpointError(f"{where}: times recorded for states {sorted(m.reached)} of a checkpoint "
                                     f"that is {m.state}")
    for name, rank in m.files.items():
        if "/" in name or name in ("", ".", "..") or not 0 <= rank < len(ranks):
            raise CorruptCheckpointError(f"{where}: data file {name!r} of rank {rank} is not one of its files")
    for name in m.index_files:
        if "/" in name or name in ("", ".", ".."):
            raise CorruptCheckpointError(f"{where}: index file {name!r} is not a plain name")
    if m.replica_nodes and (len(m.replica_nodes) != len(m.nodes) or any(
            n in r or not all(0 <= x < len(m.nodes) for x in r) for n, r in enumerate(m.replica_nodes))):
        raise CorruptCheckpointError(f"{where}: replica nodes {m.replica_nodes} do not fit {len(m.nodes)} nodes")

