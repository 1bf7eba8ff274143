"""What the group-commit writer (:mod:`app.store.writer`) holds about appends: each one
queued or in flight, and the requests whose append failed.

A failed append fails every later append of its request already submitted (they would
follow events that are not there), and the request's next submission raises the error
if no caller has seen it yet; after that the request may append again. The writer
remembers the last ``FAILURES_KEPT`` failed requests, the oldest forgotten first.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from dataclasses import dataclass

from app.store.codec import EventRow
from app.store.errors import StoreError

FAILURES_KEPT = 10_000


@dataclass(eq=False, slots=True)
class PendingAppend:
    request_id: str
    expected_version: int
    rows: Sequence[EventRow]
    ticket: int  # submission order
    durable: bool  # written at once; an outage fails it instead of keeping it queued
    done: asyncio.Future[None] | None  # settled at the commit, for a caller that waits on it
    error: StoreError | None = None
    behind_failure: bool = False  # failed because an earlier append of its request did


@dataclass(slots=True)
class _Failure:
    """A failed append: the request's appends submitted up to ``up_to_ticket`` fail too."""

    error: StoreError
    up_to_ticket: int
    reported: bool  # the caller has seen the error (raised by a durable append or the next one)


class Failures:
    """The requests whose append failed, and what that means for their other appends."""

    def __init__(self) -> None:
        self._failures: collections.OrderedDict[str, _Failure] = collections.OrderedDict()

    def add(self, request_id: str, error: StoreError, up_to_ticket: int, *, reported: bool) -> None:
        """An append of ``request_id`` failed: so do its appends up to ``up_to_ticket``."""
        self._failures[request_id] = _Failure(error, up_to_ticket, reported=reported)
        self._failures.move_to_end(request_id)
        while len(self._failures) > FAILURES_KEPT:
            self._failures.popitem(last=False)

    def behind(self, entry: PendingAppend) -> StoreError | None:
        """The error ``entry`` fails with because an earlier append of its request failed."""
        failure = self._failures.get(entry.request_id)
        if failure is not None and entry.ticket <= failure.up_to_ticket:
            return failure.error
        return None

    def check(self, request_id: str) -> None:
        """Raise the request's failure if its caller has not seen it yet (once)."""
        failure = self._failures.get(request_id)
        if failure is not None and not failure.reported:
            failure.reported = True
            raise failure.error
