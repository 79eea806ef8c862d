"""Structured log records: the notable steps of a save or load carry an event name and its fields as attributes
of their ``logging.LogRecord``, so that a program (a job monitor, a test) matches what happened, not the wording.

``logger.info("...", *args, extra=event(COMMITTED_LOCALLY, checkpoint=url))`` gives the record the attributes
``fastpersist_event`` (the name) and ``fastpersist_checkpoint``; :func:`event_of` and :func:`field_of` read
them back.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

EVENT = "fastpersist_event"
PREFIX = "fastpersist_"

COMMITTED_LOCALLY = "committed locally"  # a tiered checkpoint committed to the local tiers (rank 0)
DURABLE = "durable"  # a tiered checkpoint committed on the persistent tier (rank 0)
COPIED = "copied"  # a rank's data file copied to the persistent tier, every block checked (``when``: at what point)
WAITING_FOR_COPIES = "waiting for copies"  # a save into a directory whose earlier checkpoint's copies go on
NOT_DRAINED = "not drained"  # a tiered checkpoint kept local: the persistent tier was too far behind (rank 0)
UNREACHABLE = "unreachable"  # a tiered save went on without its persistent tier, which its drain writes later (rank 0)
RETRYING = "retrying"  # a step on the persistent tier failed and is tried again after a pause
NEXT_COPY = "next copy"  # a load left a copy of a data file (``file``, ``why``) for the next one
FETCHED = "fetched"  # a load fetched a file (``file``) from an object store into the node's local copy


def event(name: str, **fields: Any) -> dict[str, Any]:
    """The ``extra`` of a log call recording the event ``name`` with ``fields``."""
    return {EVENT: name, **{PREFIX + key: value for key, value in fields.items()}}


def event_of(record: logging.LogRecord) -> Optional[str]:
    """The event ``record`` records, or None."""
    return getattr(record, EVENT, None)


def field_of(record: logging.LogRecord, key: str) -> Any:
    """A field of the event ``record`` records (None where it has none)."""
    return getattr(record, PREFIX + key, None)
