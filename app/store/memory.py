"""An event store in memory, for tests of code above the store that need no PostgreSQL.

It passes the same contract test as the PostgreSQL store. Appends commit at once,
durable or not; a non-durable append's conflict is still only raised by the
request's next append, as the group-commit writer would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncGenerator, Awaitable, Sequence
from datetime import UTC, datetime
from typing import Any

from app.store.base import EventStore, RequestInput, ToolExecution, check_append
from app.store.codec import to_row
from app.store.content import kept_input
from app.store.errors import StoreClosed, StoreError, StreamConflict
from statemachine.events import (
    TERMINAL_EVENTS,
    DeltasDelivered,
    DeltasProduced,
    Event,
    RequestAccepted,
    ToolCallEmitted,
)


class InMemoryEventStore(EventStore):
    """The log as Python lists; positions count from 1, gap-free."""

    def __init__(self) -> None:
        self._streams: dict[str, list[tuple[str, Event]]] = {}  # request -> [(event id, event)]
        self._log: list[Event] = []
        self._unreported: dict[str, StoreError] = {}
        self._ledger: dict[str, ToolExecution] = {}
        self._inputs: dict[str, RequestInput] = {}
        self._appended = asyncio.Condition()
        self._closed = False

    async def append(
        self, request_id: str, expected_version: int, events: Sequence[Event], *, durable: bool = True
    ) -> int:
        self._check_open()
        check_append(request_id, expected_version, events)
        unreported = self._unreported.pop(request_id, None)
        if unreported is not None:
            raise unreported
        try:
            self._write(request_id, expected_version, events)
        except StreamConflict as conflict:
            if durable:
                raise
            self._unreported[request_id] = conflict
        async with self._appended:
            self._appended.notify_all()
        return expected_version + len(events)

    async def append_grouped(self, request_id: str, expected_version: int, events: Sequence[Event]) -> Awaitable[None]:
        committed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            await self.append(request_id, expected_version, events, durable=True)
        except StoreError as exc:
            if isinstance(exc, StoreClosed):
                raise
            committed.set_exception(exc)
        else:
            committed.set_result(None)
        return committed

    def _write(self, request_id: str, expected_version: int, events: Sequence[Event]) -> None:
        stream = self._streams.setdefault(request_id, [])
        new = []
        for event in events:
            row_id = to_row(event).event_id
            if event.seq <= len(stream):
                if stream[event.seq - 1][0] != row_id:
                    raise StreamConflict(request_id, expected_version, f"version {event.seq} is taken")
                continue  # already recorded, identical: a retry
            new.append((row_id, event))
        if new and new[0][1].seq != len(stream) + 1:
            detail = f"version {new[0][1].seq} does not follow the stream's last version {len(stream)}"
            raise StreamConflict(request_id, expected_version, detail)
        stream.extend(new)
        self._log.extend(event for _, event in new)

    async def read(self, request_id: str) -> list[Event]:
        self._check_open()
        return [event for _, event in self._streams.get(request_id, [])]

    async def follow(self, after_position: int = 0) -> AsyncGenerator[tuple[int, Event], None]:
        if not 0 <= after_position <= len(self._log):
            raise ValueError(f"position {after_position} is not in the log")
        position = after_position
        while not self._closed:
            while position < len(self._log):
                position += 1
                yield position, self._log[position - 1]
            async with self._appended:
                await self._appended.wait_for(functools.partial(self._moved_past, position))

    @property
    def accepting(self) -> bool:
        return not self._closed

    async def ping(self) -> None:
        self._check_open()

    async def unfinished_requests(self, *, gateway: str | None = None) -> list[str]:
        self._check_open()
        unfinished = []
        for request_id, stream in self._streams.items():
            accepted = stream[0][1]
            assert isinstance(accepted, RequestAccepted)
            ended = any(type(event) in TERMINAL_EVENTS for _, event in stream)
            if not ended and (gateway is None or accepted.gateway == gateway):
                unfinished.append((accepted.occurred_at, request_id))
        return [request_id for _, request_id in sorted(unfinished)]

    def _moved_past(self, position: int) -> bool:
        return position < len(self._log) or self._closed

    async def flush(self) -> None:
        return None

    async def close(self) -> None:
        self._closed = True
        async with self._appended:
            self._appended.notify_all()

    async def claim_tool_execution(
        self,
        idempotency_key: str,
        request_id: str,
        attempt: int,
        tool_call_id: str,
        name: str,
        arguments: str,
    ) -> bool:
        self._check_open()
        if idempotency_key in self._ledger:
            return False
        self._ledger[idempotency_key] = ToolExecution(
            idempotency_key,
            request_id,
            attempt,
            tool_call_id,
            name,
            arguments,
            "claimed",
            result=None,
            error=None,
            claimed_at=_now(),
            finished_at=None,
        )
        return True

    async def record_tool_result(self, idempotency_key: str, *, result: Any = None, error: str | None = None) -> None:
        self._check_open()
        claimed = self._ledger.get(idempotency_key)
        if claimed is None:
            raise StoreError(f"tool execution {idempotency_key} was never claimed")
        if claimed.status != "claimed":
            return  # the first recorded outcome stands
        status = "failed" if error is not None else "succeeded"
        self._ledger[idempotency_key] = dataclasses.replace(
            claimed, status=status, result=result, error=error, finished_at=_now()
        )

    async def tool_execution(self, idempotency_key: str) -> ToolExecution | None:
        self._check_open()
        return self._ledger.get(idempotency_key)

    async def record_input(
        self,
        request_id: str,
        body: dict[str, Any],
        *,
        model_revision: str | None = None,
        seed: int | None = None,
        content_policy: str | None = None,
    ) -> None:
        self._check_open()
        kept = kept_input(body, content_policy or "full")
        if kept is not None:
            self._inputs.setdefault(request_id, RequestInput(request_id, dict(kept), model_revision, seed))

    async def read_input(self, request_id: str) -> RequestInput | None:
        self._check_open()
        return self._inputs.get(request_id)

    async def erase_request(self, tenant: str, request_id: str) -> int:
        self._check_open()
        stream = self._streams.get(request_id, [])
        accepted = stream[0][1] if stream else None
        if not isinstance(accepted, RequestAccepted) or accepted.tenant != tenant:
            return 0
        self._streams[request_id] = [(event_id, _without_content(event)) for event_id, event in stream]
        self._inputs.pop(request_id, None)
        for key, execution in self._ledger.items():
            if execution.request_id == request_id:
                self._ledger[key] = dataclasses.replace(execution, arguments="", result=None, error=None)
        return 1

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("the event store is closed")


def _without_content(event: Event) -> Event:
    """``event`` as if recorded under the "none" content policy."""
    if isinstance(event, DeltasDelivered | DeltasProduced):
        return dataclasses.replace(
            event, text=None, text_sha256=None, logprobs=None, token_ids=(), prompts=(), prompt_logprobs=()
        )
    if isinstance(event, ToolCallEmitted):
        return dataclasses.replace(event, arguments="", arguments_sha256=None)
    return event


def _now() -> datetime:
    return datetime.now(UTC)
