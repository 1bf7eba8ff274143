"""What every request driver shares: the store, the pool, the budget, the clocks."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from app.config import GatewayConfig
from app.driver.batch_ages import BatchAges
from app.driver.budget import RetryBudget
from app.replicas.pool import ReplicaPool
from app.replicas.replica import Replica
from app.store.base import EventStore
from app.store.idempotency import IdempotencyKeys
from app.telemetry.metrics import Metrics
from statemachine.events import Event
from statemachine.request_state import RequestState

log = logging.getLogger("phasegate.driver")

ToolRunner = Callable[[dict[str, Any]], Awaitable[Any]]


def utc_now() -> datetime:
    return datetime.now(UTC)


class LiveRequest(Protocol):
    """A request in flight, as the gateway keeps it (a :class:`~app.driver.driver.RequestDriver`)."""

    @property
    def request_id(self) -> str: ...

    @property
    def state(self) -> RequestState: ...

    @property
    def accepted_at(self) -> float:
        """When the request was accepted, on the monotonic clock."""
        ...

    @property
    def told(self) -> tuple[str, str] | None:
        """The final error (code, message) its client was told that the log could not take
        then (its log was lost), while this process still has to close it; else ``None``.
        A sweep of this process closes it with that code (app/driver/instance.py)."""
        ...

    def interrupt(self, code: str, message: str, *, record: bool) -> None: ...

    def cancel_now(self) -> None: ...

    def fence_drained(self, replica: Replica) -> bool:
        """Its live attempt, if on ``replica``, fails as ``replica_drained`` (its drain
        deadline passed: docs/design.md §16); whether it did."""
        ...


class Tracing(Protocol):
    """What the driver tells tracing (app/telemetry/tracing.py), which it must not import: the trace
    of a request being accepted, and every event it records. Called synchronously, on
    the request's path: an implementation does little and never raises."""

    def trace_id(self) -> str | None:
        """The trace of the request accepted now (the current context's), if it is traced."""
        ...

    def recorded(self, state: RequestState, event: Event) -> None:
        """``event`` was recorded; ``state`` is the request with it applied."""
        ...


class NotTraced:
    """Tracing off: nothing is traced."""

    def trace_id(self) -> str | None:
        return None

    def recorded(self, state: RequestState, event: Event) -> None:
        return None


@dataclass
class GatewayContext:
    config: GatewayConfig
    store: EventStore
    pool: ReplicaPool
    budget: RetryBudget
    metrics: Metrics
    # The wall clock stamps events; the monotonic clock measures timeouts. Both are
    # inputs so that tests can control them; statemachine/ never reads either.
    wall_clock: Callable[[], datetime] = utc_now
    clock: Callable[[], float] = time.monotonic
    gateway_id: str = "gateway"  # this instance's id, recorded on every request it accepts
    idempotency: IdempotencyKeys | None = None  # the Idempotency-Key table (PostgreSQL only)
    # monotonic: until when this instance may deliver (its lease as it must assume it);
    # app/driver/instance.py keeps it, unbounded without one
    lease_valid_until: float = math.inf
    refusal: str | None = None  # why new requests get 503 now: gateway_draining, gateway_lost
    tool_runner: ToolRunner | None = None  # executes a tool call once per idempotency key
    tracing: Tracing = field(default_factory=NotTraced)  # spans per attempt, when tracing is on
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    batch_ages: BatchAges = field(default_factory=BatchAges)  # the open delivery batches' deadlines
    drivers: dict[str, LiveRequest] = field(default_factory=dict)  # by request id, until it is done
    # told of each configuration reload (the API keys, the tenants' limits), after ``config`` changed
    reloaded: list[Callable[[GatewayConfig], None]] = field(default_factory=list)

    def lease_lapsed(self) -> bool:
        """This instance's lease lapsed (a pause, a partition): nothing more goes out to
        clients, even before the lease's own timer runs (docs/design.md §11)."""
        return self.clock() >= self.lease_valid_until

    def spawn(self, coroutine: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run bookkeeping that must outlive the HTTP exchange (fences after the end,
        cancels after a disconnect); the gateway awaits these on shutdown."""
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self.background.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self.background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s failed", task.get_name(), exc_info=task.exception())

    async def drain(self, timeout_s: float) -> None:
        """Wait for background bookkeeping, then cancel what is left."""
        if not self.background:
            return
        _, pending = await asyncio.wait(set(self.background), timeout=timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
