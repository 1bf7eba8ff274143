"""The event store's port: one interface, every implementation passes one contract test.

The request driver is the only writer of a request's stream. It appends with the
version it last saw (``expected_version``, 0 for a new request); the store refuses
anything that does not continue the stream exactly (:class:`StreamConflict`).

Two kinds of append share one ordered pipeline, so a request's events land in seq
order even when cheap deliveries are followed by a durable terminal event:

- ``durable=True`` returns once the events are committed: the commit point and the
  terminal events are awaited before the bytes they guard.
- ``durable=False`` returns once the events are queued (it waits while the queue is
  full); they are committed within the store's flush delay, together with other
  requests' events. A conflict found then is raised by that request's next append.
  ``flush()`` and ``close()`` commit everything queued.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncGenerator, Awaitable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from app.store.errors import InvalidAppend
from statemachine.events import Event, RequestAccepted


@dataclass(frozen=True, slots=True)
class ToolExecution:
    """One logical tool action in the ledger, run once however many attempts asked."""

    idempotency_key: str
    request_id: str
    attempt: int
    tool_call_id: str
    name: str
    arguments: str
    status: str  # "claimed", "succeeded" or "failed"
    result: Any
    error: str | None
    claimed_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True, slots=True)
class RequestInput:
    """What a request asked for, kept so that an incident can be replayed."""

    request_id: str
    body: dict[str, Any]
    model_revision: str | None
    seed: int | None


class EventStore(abc.ABC):
    """Append, read and follow request streams; the tool ledger; recorded inputs."""

    @abc.abstractmethod
    async def append(
        self, request_id: str, expected_version: int, events: Sequence[Event], *, durable: bool = True
    ) -> int:
        """Append ``events`` (seq ``expected_version + 1`` onwards); returns the new version.

        Appending events that are already recorded, identical, is a no-op.
        """

    @abc.abstractmethod
    async def append_grouped(self, request_id: str, expected_version: int, events: Sequence[Event]) -> Awaitable[None]:
        """Queue ``events`` for a group commit without hurrying it, and return once they
        are queued: the awaitable returned completes when they are committed, or raises
        the append's :class:`~app.store.errors.StoreError`. Through an outage they stay
        queued and the awaitable waits."""

    def append_grouped_now(
        self, request_id: str, expected_version: int, events: Sequence[Event]
    ) -> asyncio.Future[None] | None:
        """:meth:`append_grouped` in the caller's own step, where queueing needs no wait:
        the future that settles at the commit, or ``None`` when it would wait (then
        nothing was queued: call :meth:`append_grouped`). A store that cannot queue in
        one step says ``None`` always."""
        return None

    @abc.abstractmethod
    async def read(self, request_id: str) -> list[Event]:
        """The request's committed events in seq order (empty for an unknown request)."""

    @abc.abstractmethod
    def follow(self, after_position: int = 0) -> AsyncGenerator[tuple[int, Event], None]:
        """Every committed event after ``after_position``, each once, as ``(position, event)``.

        ``after_position`` is 0 or a position this iterator returned. The iterator
        waits for new events and ends only when the store closes (or when closed
        with ``aclose()``).
        """

    @abc.abstractmethod
    async def unfinished_requests(self, *, gateway: str | None = None) -> list[str]:
        """Requests with no terminal event, oldest first; only ``gateway``'s when it is given.

        A restarted gateway uses it to find and close the requests it left behind.
        """

    @property
    @abc.abstractmethod
    def accepting(self) -> bool:
        """Whether appends can be written now, as last seen (no I/O): ``False`` during an
        outage the writer noticed, or once closed. New requests are refused meanwhile."""

    @abc.abstractmethod
    async def ping(self) -> None:
        """Raise :class:`StoreUnavailable` unless the log can take appends now."""

    @abc.abstractmethod
    async def flush(self) -> None:
        """Wait until every append made so far is committed."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Commit everything accepted, then release the connections. Idempotent."""

    @abc.abstractmethod
    async def claim_tool_execution(
        self,
        idempotency_key: str,
        request_id: str,
        attempt: int,
        tool_call_id: str,
        name: str,
        arguments: str,
    ) -> bool:
        """Claim the tool action; ``True`` only for the first claimer of ``idempotency_key``."""

    @abc.abstractmethod
    async def record_tool_result(self, idempotency_key: str, *, result: Any = None, error: str | None = None) -> None:
        """Record how a claimed tool action ended: its JSON ``result``, or an ``error``."""

    @abc.abstractmethod
    async def tool_execution(self, idempotency_key: str) -> ToolExecution | None:
        """The ledger entry of ``idempotency_key``, if claimed."""

    @abc.abstractmethod
    async def record_input(
        self,
        request_id: str,
        body: dict[str, Any],
        *,
        model_revision: str | None = None,
        seed: int | None = None,
        content_policy: str | None = None,
    ) -> None:
        """Keep the request's input, as ``content_policy`` (the store's own where ``None``)
        says; recording it again is a no-op."""

    @abc.abstractmethod
    async def read_input(self, request_id: str) -> RequestInput | None:
        """The recorded input of ``request_id``, if any."""

    @abc.abstractmethod
    async def erase_request(self, tenant: str, request_id: str) -> int:
        """Remove the content of ``tenant``'s request ``request_id`` (its input, delivered
        and produced text, tool arguments and results); the events, their order and every
        count stay (docs/design.md §13). How many of the tenant's requests it named (0 or 1)."""


def check_append(request_id: str, expected_version: int, events: Sequence[Event]) -> None:
    """Raise :class:`InvalidAppend` unless ``events`` continue ``request_id`` at ``expected_version``."""
    if expected_version < 0:
        raise InvalidAppend(f"expected_version must not be negative, got {expected_version}")
    if not events:
        raise InvalidAppend("append needs at least one event")
    for offset, event in enumerate(events, start=1):
        if event.request_id != request_id:
            raise InvalidAppend(f"{type(event).__name__} belongs to request {event.request_id}, not {request_id}")
        if event.seq != expected_version + offset:
            raise InvalidAppend(
                f"{type(event).__name__} has seq {event.seq}, expected {expected_version + offset} "
                f"(appending after version {expected_version})"
            )
        if event.occurred_at.tzinfo is None:
            raise InvalidAppend(f"{type(event).__name__} occurred_at has no UTC offset")
        if isinstance(event, RequestAccepted) != (event.seq == 1):
            # the read models are keyed by what RequestAccepted says about the request
            raise InvalidAppend(f"a request's stream begins with RequestAccepted, and only there (seq {event.seq})")
