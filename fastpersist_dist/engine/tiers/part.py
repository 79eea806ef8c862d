"""One rank's part of the background work on one tiered checkpoint: what its replication and drain threads get."""

from __future__ import annotations

from dataclasses import dataclass

from ...format.tiers import TierManifest


@dataclass(frozen=True)
class RankPart:
    """Which checkpoint, where this node keeps it, and who this rank is (for messages)."""

    manifest: TierManifest
    local: str  # this node's copy of the checkpoint
    rank: int
    node: str  # this node, for messages
