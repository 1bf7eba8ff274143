"""Lease renewal for every attempt held on one replica, in one call per round.

How this works: an attempt joins its replica's :class:`LeaseRenewer` once it started
and leaves when it is released. While any attempt is held, the renewer wakes every
third of the lease TTL and renews all of them in one request (``/v1/leases/renew``
on a worker), each renewal numbered for its attempt and naming the last one whose
answer came (``next_renewal``), then tells each renewed attempt (``lease_renewed``),
which stamps the time the answer came: no earlier than the worker read it. A renewal
the replica refuses is not told (the lease then lapses on both sides); a round unanswered
within a TTL is logged and the next round tries again.

Why the gateway's view of a lease never ends before the worker's: a renewal the worker
read whose answer a cut lost extends the worker's lease, and not the gateway's view. So
the worker extends a lease no further than ``RENEWAL_SLACK`` TTLs past the TTL of the
last renewal answered (app/worker/attempt.py), and while a renewal is unanswered the
gateway's view runs that much longer (``AttemptRun.lease_expires_in``): a ``LeaseExpired``
it records is a lease the worker let lapse too.

Why one call per round and not one per attempt: per-attempt renewals were the limit
on held streams (their number grows with the streams, and leases lapsed under that load;
ops/bench/overhead.py, figures: docs/performance.md). One round per replica costs the
same at any number of streams.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from app.replicas.base import AttemptRequest, ReplicaClient, UpstreamFailure
from app.telemetry import logs, tracing

log = logging.getLogger("phasegate.pool")


class Leased(Protocol):
    request: AttemptRequest

    def next_renewal(self) -> tuple[int, int]: ...

    def lease_renewed(self, renewal: int) -> None: ...


class LeaseRenewer:
    def __init__(self, client: ReplicaClient) -> None:
        self.client = client
        self._held: dict[tuple[str, int], Leased] = {}
        self._task: asyncio.Task[None] | None = None

    def hold(self, attempt: Leased) -> None:
        """Renew ``attempt``'s lease from the next round on, until :meth:`drop`."""
        self._held[attempt.request.request_id, attempt.request.attempt] = attempt
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                # the rounds serve every request on the replica: their lines name none of them
                self._rounds(),
                name=f"lease renewals on {self.client.replica_id}",
                context=tracing.without_span(logs.detached()),
            )

    async def drop(self, attempt: Leased) -> None:
        """Stop renewing ``attempt``; the last one out stops the rounds."""
        self._held.pop((attempt.request.request_id, attempt.request.attempt), None)
        if not self._held and self._task is not None:
            task, self._task = self._task, None
            task.cancel()
            await asyncio.wait((task,))  # the rounds are over; nothing of theirs is raised here

    async def _rounds(self) -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        while self._held:
            ttl = min(attempt.request.lease_ttl_s for attempt in self._held.values())
            # rounds start every third of a TTL, however long the last one took to answer
            await asyncio.sleep(max(0.0, began + ttl / 3 - loop.time()))
            began = loop.time()
            held = list(self._held.values())
            if held:
                # A slow answer still counts (the worker renews when it reads the call);
                # after a whole TTL every lease the round carried has lapsed anyway.
                await self._renew(held, ttl)

    async def _renew(self, held: list[Leased], timeout: float) -> None:
        renewals = [(attempt.request, *attempt.next_renewal()) for attempt in held]
        try:
            async with asyncio.timeout(timeout):
                renewed = await self.client.renew_all(renewals)
        except (TimeoutError, UpstreamFailure, OSError) as exc:
            log.warning("lease renewals of %d attempts on %s failed: %r", len(held), self.client.replica_id, exc)
            return
        except Exception:
            # A malformed answer loses this round, not the renewals of every attempt held
            # on the replica: the next round tries again.
            log.exception("lease renewal round on %s failed", self.client.replica_id)
            return
        if len(renewed) != len(held):
            replica = self.client.replica_id
            log.error("lease renewal round on %s: %d answers for %d leases", replica, len(renewed), len(held))
            return
        for attempt, (_, number, _), ok in zip(held, renewals, renewed, strict=True):
            if ok:
                attempt.lease_renewed(number)
