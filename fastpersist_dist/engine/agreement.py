"""Ranks fail together: when one cannot go on, every rank of the group raises, and none is left waiting.

A collective step gathers every rank's value; a rank that cannot go on sends
:class:`Failed` (its reason) in that value's place, and every rank raises the
same error listing every reason. A rank that died or hung past the process
group's timeout makes the gather itself fail, which becomes the same kind of
error naming the step. Saves use it before anything is written (directory
checks, plan exchange, invalidation: ``SaveFailedError``); shared loads when
a rank's read fails (its peers would otherwise wait for its sends).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn, Optional

import torch.distributed as dist

from ..util.errors import SaveFailedError

# Above this many ranks with a value, :meth:`Agreement.agree_sparse` gathers (one collective) rather than broadcasts
# (one per rank with a value, each its own round trip across the group).
SPARSE_MAX_SENDERS = 64


@dataclass(frozen=True)
class Failed:
    """What a rank that cannot go on contributes to a gather in place of its value."""

    error: str


@dataclass(frozen=True)
class Agreement:
    """How the ranks of one operation fail together: the error they raise and what it says.

    ``refused`` starts the message when ranks sent :class:`Failed` (their
    reasons follow); ``lost`` is the message when a rank died or timed out
    during a gather (torch's error follows).
    """

    error: type[Exception]
    refused: str
    lost: str

    def gather(self, value: Any, group: Optional[dist.ProcessGroup] = None) -> list[Any]:
        """Every rank's ``value`` (collective over ``group``, default the world); ``Failed`` values included."""
        values: list[Any] = [None] * dist.get_world_size(group)
        try:
            dist.all_gather_object(values, value, group=group)
        except RuntimeError as e:  # torch's DistError family: a rank died or timed out
            raise self.error(f"{self.lost} ({e})") from e
        return values

    def raise_if(self, failures: list[Optional[str]]) -> None:
        """Raise one error listing every failure, if there is any (a group's failure arrives once per member)."""
        failures = list(dict.fromkeys(f for f in failures if f))
        if failures:
            raise self.error(f"{self.refused}: " + " | ".join(failures))

    def agree(self, value: Any, group: Optional[dist.ProcessGroup] = None) -> list[Any]:
        """Every rank's ``value`` (collective); raises on every rank if any rank sent :class:`Failed`."""
        values = self.gather(value, group)
        self.raise_if([v.error for v in values if isinstance(v, Failed)])
        return values

    def agree_sparse(self, value: Any, group: Optional[dist.ProcessGroup] = None,
                     dense_above: int = SPARSE_MAX_SENDERS) -> list[Any]:
        """Every rank's ``value`` (collective), None for an empty (falsy) one, where most ranks' is empty.

        ``all_gather_object`` pads every value to the largest, so that every rank
        would receive world x that size; here each rank receives the non-empty
        values only: one gather of a flag per rank (where a rank's
        :meth:`fail_together` fits), then a broadcast of each non-empty value,
        or, where more than ``dense_above`` ranks have one, one gather of them all.
        """
        senders = [r for r, full in enumerate(self.agree(bool(value), group)) if full]
        if len(senders) > dense_above:
            return [v or None for v in self.gather(value, group)]
        values: list[Any] = [None] * dist.get_world_size(group)
        me = dist.get_rank(group)
        for r in senders:
            box = [value if r == me else None]
            try:
                dist.broadcast_object_list(box, group=group, group_src=r)
            except RuntimeError as e:  # torch's DistError family: a rank died or timed out
                raise self.error(f"{self.lost} ({e})") from e
            values[r] = box[0]
        return values

    def fail_together(self, error: BaseException, group: Optional[dist.ProcessGroup] = None) -> NoReturn:
        """Tell the group this rank failed (in place of its next :meth:`agree`), then raise ``error`` here."""
        me = dist.get_rank(group)
        try:
            self.agree(Failed(f"group rank {me}: {type(error).__name__}: {error}"), group)
        except self.error:
            pass  # the others' error: this rank reports its own
        raise error


def failure(error: Optional[str]) -> Optional[Failed]:
    """``error`` as a rank's contribution to :meth:`Agreement.agree` (None: nothing wrong here)."""
    return Failed(error) if error else None


def before_writing(what: str) -> Agreement:
    """The agreement of a save's steps before its first byte is written: ``SaveFailedError`` saying so."""
    return Agreement(SaveFailedError, f"{what}; nothing was written",
                     f"{what}; rank {dist.get_rank()}: a rank died or timed out before anything was written")
