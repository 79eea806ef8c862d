"""How far a tiered checkpoint got, as its persistent directory's manifest records it (``local``, ``replicated``,
``durable``), written by rank 0 only and never backwards; the markers beside it; the API to ask or wait.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Iterator, Optional

from ...format.checksum import digest_bytes
from ...format.kinds import DCP_METADATA_FILE
from ...format.records import CONTAINER_TORCH_SAVE, INDEX_FILE
from ...format.tiers import DRAINED_PREFIX, DURABLE, PENDING_DIR, STATES, TIERS_FILE, TierManifest
from ...storage.persistent import PersistentDir, is_object_store, persistent_dir
from ...util.errors import CorruptCheckpointError, FastPersistError
from ..index_reader import parse_top_bytes

logger = logging.getLogger(__name__)

POLL_S = 0.2  # the longest pause of a wait between its looks at a directory
POLL_OBJECT_STORE_S = 1.0  # ... at an object store (each look is a request)
FIRST_POLL_FRACTION = 1 / 16  # a wait's first pause, of the longest

_advancing = threading.Lock()


def pauses(longest: float) -> Iterator[float]:
    """The pauses of a wait between its looks: short at first (what it waits for mostly ends soon), then doubling
    up to ``longest``."""
    pause = longest * FIRST_POLL_FRACTION
    while True:
        yield pause
        pause = min(pause * 2, longest)


def poll_pauses(checkpoint_dir: str) -> Iterator[float]:
    """:func:`pauses` of a wait looking at ``checkpoint_dir`` (longer on an object store: each look a request)."""
    return pauses(POLL_OBJECT_STORE_S if is_object_store(checkpoint_dir) else POLL_S)


def read_manifest(where: PersistentDir) -> Optional[TierManifest]:
    """The tiers manifest of ``where`` (a persistent directory or a node's copy), None where there is none."""
    data = where.read(TIERS_FILE)
    return None if data is None else TierManifest.from_json_bytes(data, where.where(TIERS_FILE))


def advance(manifest: TierManifest, state: str) -> bool:
    """Record ``state`` for ``manifest``'s checkpoint in its persistent directory (rank 0); whether it did: not
    where a newer save took the directory over, nor backwards."""
    home = persistent_dir(manifest.checkpoint_dir)
    with _advancing:
        current = read_manifest(home)
        if current is None or current.checkpoint_id != manifest.checkpoint_id:
            return False
        if STATES.index(current.state) >= STATES.index(state):
            return False
        now = time.time()
        home.write(TIERS_FILE, current.with_state(state, now).to_json_bytes())
    logger.info("fastpersist: %s is %s, %.2f s after its local commit", manifest.checkpoint_dir, state,
                now - current.created)
    return True


def superseded(manifest: TierManifest) -> bool:
    """Whether a newer save took ``manifest``'s persistent directory over (its manifest is of another id)."""
    current = read_manifest(persistent_dir(manifest.checkpoint_dir))
    return current is None or current.checkpoint_id != manifest.checkpoint_id


def drained_marker(manifest: TierManifest, data_file: str) -> str:
    """The persistent directory's marker of ``data_file`` of ``manifest``'s checkpoint copied there and checked."""
    return f"{DRAINED_PREFIX}{manifest.checkpoint_id}.{data_file}"


def failed_marker(manifest: TierManifest, data_file: str) -> str:
    """... of its copy failed for good (holding the rank and the error)."""
    return f"{DRAINED_PREFIX}{manifest.checkpoint_id}.{data_file}.failed"


def drained_files(home: PersistentDir, manifest: TierManifest, names: Optional[set[str]] = None) -> set[str]:
    """The data files of ``manifest``'s checkpoint copied to ``home`` and checked (``names``: ``home``'s listing,
    if at hand; else one listing)."""
    names = set(home.names()) if names is None else names
    return {f for f in manifest.files if drained_marker(manifest, f) in names}


def mark_failed(home: PersistentDir, manifest: TierManifest, data_file: str, rank: int, error: str) -> None:
    """Record in ``home`` that rank ``rank``'s copy of ``data_file`` failed for good, and why."""
    home.write(failed_marker(manifest, data_file), json.dumps({"rank": rank, "error": error}).encode())


def failed_copies(home: PersistentDir, manifest: TierManifest, names: Optional[set[str]] = None) -> dict[str, str]:
    """The data files of ``manifest``'s checkpoint whose copy to ``home`` failed for good, each with what its rank
    said (``names``: ``home``'s listing, if at hand)."""
    names = set(home.names()) if names is None else names
    failed = {}
    for f in sorted(manifest.files):
        if failed_marker(manifest, f) in names:
            try:
                failed[f] = str(json.loads(home.read(failed_marker(manifest, f)) or b"{}").get("error", "?"))
            except ValueError:
                failed[f] = "? (its failure marker is unreadable)"
    return failed


def pending_dir(home: PersistentDir) -> PersistentDir:
    """Where the index of a checkpoint that is not durable yet waits, beside its data."""
    return home.sub(PENDING_DIR)


def check_current(home: PersistentDir, manifest: TierManifest, who: str) -> None:
    """The manifest describes what is committed in its directory: an index committed there is the one it names,
    and a torch DCP ``.metadata`` there the one committed with that index (either comes only with the drain's
    commit). Another save into the directory after the tiered one that knew nothing of its manifest (megatron's
    own ``torch_dist``) would otherwise send the load to the local copies of the checkpoint it replaced."""
    index, metadata = home.read(INDEX_FILE), home.read(DCP_METADATA_FILE)
    if index is None and metadata is None:
        return
    remove = TIERS_FILE
    if index is None:
        why = f"a torch DCP {DCP_METADATA_FILE} but no {INDEX_FILE}"
    elif digest_bytes(index) != manifest.index_xxh3_64:
        why = f"a committed {INDEX_FILE} that is not the index the manifest names"
    else:
        top = parse_top_bytes(index, home.where(INDEX_FILE), who)
        if metadata is None or (top.container == CONTAINER_TORCH_SAVE
                                and digest_bytes(metadata) == top.metadata_xxh3_64):
            return
        why = f"a torch DCP {DCP_METADATA_FILE} that is not the one committed with its {INDEX_FILE}"
        remove = f"{TIERS_FILE} and {INDEX_FILE}"
    raise CorruptCheckpointError(
        f"{who}: {manifest.checkpoint_dir} holds the tiers manifest of checkpoint {manifest.checkpoint_id} "
        f"({manifest.state}) and {why}: another save wrote into that directory after it without tiers (e.g. "
        f"megatron's own torch_dist), so its local copies are not of what the directory holds and which checkpoint "
        f"is meant is unknown; to load the one written there last, remove {remove} from it")


def checkpoint_state(checkpoint_dir: str) -> Optional[str]:
    """``"local"``, ``"replicated"`` or ``"durable"`` for a tiered checkpoint; ``"durable"`` for one saved
    straight to ``checkpoint_dir`` and committed; None where nothing is committed there (yet). A manifest that
    says durable is checked as a load would (:func:`check_current`)."""
    home = persistent_dir(str(checkpoint_dir))
    manifest = read_manifest(home)
    if manifest is not None:
        if manifest.state == DURABLE:
            check_current(home, manifest, "checkpoint_state")
        return manifest.state
    return DURABLE if INDEX_FILE in home.names() else None


def wait_durable(checkpoint_dir: str, timeout: Optional[float] = None) -> bool:
    """Wait until ``checkpoint_dir`` is durable (at most ``timeout`` seconds); whether it is. A persistent tier
    out of reach for a while is waited for too, logged; a damaged manifest raises."""
    end = None if timeout is None else time.monotonic() + timeout
    waits = poll_pauses(str(checkpoint_dir))
    while True:
        try:
            if checkpoint_state(checkpoint_dir) == DURABLE:
                return True
        except CorruptCheckpointError:
            raise
        except FastPersistError as e:
            logger.warning("fastpersist: cannot ask the state of %s yet (%s); waiting", checkpoint_dir, e)
        if end is not None and time.monotonic() > end:
            return False
        time.sleep(next(waits))


def newest_durable_beside(checkpoint_dir: str) -> str:
    """'; the newest durable checkpoint beside it is X' (or that there is none), for refusals."""
    home = persistent_dir(str(checkpoint_dir))
    found = []
    for other in home.siblings():
        try:
            manifest = read_manifest(other)
            if manifest is not None and manifest.state == DURABLE:
                found.append((manifest.created, other.url))
            elif manifest is None and INDEX_FILE in other.names():
                found.append((0.0, other.url))  # saved straight there: durable, of unknown age
        except FastPersistError:
            continue
    if not found:
        return "; no durable checkpoint lies beside it"
    return f"; the newest durable checkpoint beside it is {max(found)[1]}"
