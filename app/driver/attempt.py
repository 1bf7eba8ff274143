"""One attempt on one replica: its stream, its lease, its timers.

How this works: ``open`` starts the attempt on the replica. While the driver reads,
its replica's renewer renews the lease every third of its TTL, in one call with the
replica's other attempts (app/replicas/renewer.py). ``next_frame`` reads the
next frame under a stall deadline: a worker sends heartbeats while queued, so silence
means liveness is uncertain; an OpenAI-compatible upstream is silent during prefill,
so before its first token only its own first-token deadline applies
(``openai_first_token_s``, counted from the attempt's start; an answer asked unstreamed,
whose first frame comes with its last: ``first_token_hard_s``). The deadline is one
timer an attempt (``_StallWatch``), not a timeout armed and disarmed per frame: it
fires at the deadline of the read in progress, and moves on when reads went on. A timer
that fires late because the loop was busy (a gateway at saturation) waits as long
again before it fails the attempt: the frames it did not see may be in the socket,
unread, and a slow gateway must not be charged to a healthy replica. Heartbeats
that show queueing turn into the soft and then the hard first-token deadline, each
reported once (``deadline_due``). ``release`` stops renewing and closes the stream;
the lease then lapses on the replica unless a cancel ends it first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from app.config import Timeouts
from app.contract.worker_protocol import RENEWAL_SLACK
from app.replicas.base import AttemptRequest, AttemptStream, Frame, Heartbeat, Token, UpstreamFailure
from app.replicas.pool import REPLICA_DRAINED
from app.replicas.replica import Replica
from statemachine.events import Deadline, FailureKind

log = logging.getLogger("phasegate.driver")


class AttemptRun:
    def __init__(
        self, replica: Replica, request: AttemptRequest, *, clock: Callable[[], float], timeouts: Timeouts
    ) -> None:
        self.replica = replica
        self.request = request
        self.clock = clock  # monotonic seconds: the lease and the timers
        self.timeouts = timeouts
        self.started_at = clock()
        # the lease as the gateway sees it: from when the start's answer came (or the
        # gateway gave up on it), renewed from when each renewal's answer came
        # (app/replicas/renewer.py)
        self.renewed_at = self.started_at
        self.renewals_sent = 0
        self.renewals_answered = 0  # the number of the last renewal whose answer came (0: none)
        self.first_token_seen = False
        self.deadlines_reported: set[Deadline] = set()
        self.generated_tokens = 0  # token frames read
        self.deltas = 0  # of them, those that carried a delta for the client (the first: the commit point)
        self._stream: AttemptStream | None = None
        self._frames: AsyncIterator[Frame] | None = None
        self._watch: _StallWatch | None = None
        self._released = False
        self.drained = False  # its replica's drain deadline passed (docs/design.md §16)
        replica.outstanding += 1

    @property
    def attempt(self) -> int:
        return self.request.attempt

    @property
    def lease_epoch(self) -> int:
        return self.request.lease_epoch

    @property
    def lease_expires_in(self) -> float:
        """Seconds until the lease has surely lapsed on the replica: a TTL from the last
        answer, and ``RENEWAL_SLACK`` TTLs more while a renewal is unanswered (the
        worker may have read it: it extends the lease no further than that)."""
        ttl = self.request.lease_ttl_s
        if self.renewals_sent > self.renewals_answered:
            ttl *= 1 + RENEWAL_SLACK
        return self.renewed_at + ttl - self.clock()

    async def open(self) -> None:
        """Start the attempt on the replica; raises :class:`UpstreamFailure` if it cannot,
        or if no answer comes within the upstream response deadline (the request may
        have reached the replica: its liveness is then uncertain)."""
        deadline = self.timeouts.upstream_response_s
        try:
            async with asyncio.timeout(deadline):
                self._stream = await self.replica.client.start(self.request)
        except TimeoutError:
            raise UpstreamFailure(
                FailureKind.LIVENESS_UNCERTAIN, f"no answer to the start within {deadline:g}s"
            ) from None
        finally:  # a worker read the start, and began its lease, no later than now
            self.renewed_at = self.clock()
        self._frames = aiter(self._stream.frames())
        self._watch = _StallWatch()
        self.replica.renewer.hold(self)
        request = self.request
        log.debug(
            "request %s: attempt %d started on %s",
            request.request_id,
            request.attempt,
            self.replica.id,
            extra={"attempt": request.attempt},
        )

    def offer_tokens(self, take: Callable[[list[Token]], bool]) -> None:
        """Have the stream offer ``take`` the tokens of each read as it arrives, in the
        connection's own callback, while the next frame is awaited (a stream that can:
        one over the lean connections, ``OpenAIStream.offer_tokens``,
        ``AttemptFrames.offer_tokens``).
        Tokens taken count as frames read: the stall deadline starts again."""
        offer = getattr(self._stream, "offer_tokens", None)
        if offer is None:
            return

        def taken(tokens: list[Token]) -> bool:
            watch = self._watch
            assert watch is not None
            if watch.fired or not take(tokens):  # (the stall deadline cancelled the read: too late)
                return False
            self.replica.frames_read += len(tokens)
            watch.reading(self.timeouts.stall_s)  # the read waiting now began now
            return True

        offer(taken)

    def next_renewal(self) -> tuple[int, int]:
        """The number of the renewal the renewer sends now, and of the last one answered."""
        self.renewals_sent += 1
        return self.renewals_sent, self.renewals_answered

    def lease_renewed(self, renewal: int) -> None:
        """The replica extended the lease (renewal ``renewal``'s answer came just now)."""
        self.renewed_at = self.clock()
        self.renewals_answered = renewal

    async def next_frame(self) -> Frame:
        """The next frame, or :class:`UpstreamFailure` when the stream breaks or stalls."""
        assert self._frames is not None and self._watch is not None and self._stream is not None, "open() first"
        if self.drained:
            raise self._drained_failure()
        timeouts = self.timeouts
        silent_prefill = not self.first_token_seen and not self.replica.client.sends_heartbeats
        if silent_prefill:  # an OpenAI upstream: its first-token deadline runs from the start
            first_token_s = min(timeouts.openai_first_token_s, timeouts.first_token_hard_s)
            if self._stream.unstreamed:  # whole: its first frame comes with its last
                first_token_s = timeouts.first_token_hard_s
            limit = max(first_token_s - (self.clock() - self.started_at), 0.0)
        else:
            limit = timeouts.stall_s
        watch = self._watch
        watch.reading(limit)
        try:
            frame = await anext(self._frames)
        except asyncio.CancelledError:
            if watch.read_ended():  # the deadline passed, and nobody else cancelled the read
                if self.drained:
                    raise self._drained_failure() from None
                what = f"no first token within {first_token_s:g}s" if silent_prefill else f"no frame for {limit:g}s"
                raise UpstreamFailure(FailureKind.LIVENESS_UNCERTAIN, what) from None
            raise
        except StopAsyncIteration:
            watch.read_ended()
            raise UpstreamFailure(FailureKind.REPLICA_EXITED, "the stream ended before the attempt finished") from None
        except BaseException:
            watch.read_ended()
            raise
        watch.read_ended()
        if not isinstance(frame, Heartbeat):
            self.first_token_seen = True
            # proof that its engine works, should a probe of it go unanswered meanwhile (a
            # heartbeat proves less: an engine stuck with its queue full still sends them)
            self.replica.frames_read += 1
        return frame

    def drain(self) -> None:
        """Its replica's drain deadline passed: the read in progress (or the next) fails with
        ``replica_drained``, fenced as any attempt whose liveness is uncertain (§7); it never
        counts toward ejecting the replica (``GATEWAYS_DOING``)."""
        if self.drained or self._released:
            return
        self.drained = True
        watch = self._watch
        if watch is not None and watch.since is not None and watch.task is not None and not watch.fired:
            watch.fired = True  # as the stall deadline ends a read: this watch's cancel, and only it
            watch.task.cancel()

    def _drained_failure(self) -> UpstreamFailure:
        return UpstreamFailure(
            FailureKind.LIVENESS_UNCERTAIN,
            f"replica {self.replica.id} was cordoned and its drain deadline passed",
            code=REPLICA_DRAINED,
        )

    def deadline_due(self) -> Deadline | None:
        """A first-token deadline that has passed and was not reported yet."""
        if self.first_token_seen:
            return None
        waited = self.clock() - self.started_at
        timeouts = self.timeouts
        for deadline, limit in (
            (Deadline.HARD, timeouts.first_token_hard_s),
            (Deadline.SOFT, timeouts.first_token_soft_s),
        ):
            if waited >= limit and deadline not in self.deadlines_reported:
                self.deadlines_reported.update({deadline, Deadline.SOFT})
                return deadline
        return None

    async def release(self) -> None:
        """Stop renewing, stop reading, give the replica's slot back. Idempotent."""
        if self._released:
            return
        self._released = True
        if self._watch is not None:
            self._watch.stop()
        self.replica.outstanding -= 1
        await self.replica.renewer.drop(self)
        if self._stream is not None:
            with contextlib.suppress(Exception):
                await self._stream.close()

    async def cancel(self) -> int | None:
        """Ask the replica to abort; its generated token count once it confirmed, or
        ``None`` when no acknowledgement came in time (or the replica gives none)."""
        client, request = self.replica.client, self.request
        if not client.acknowledges_cancel:
            return None
        try:
            return await asyncio.wait_for(
                client.cancel(request.request_id, request.attempt, request.lease_epoch),
                timeout=self.timeouts.cancel_ack_s,
            )
        except (TimeoutError, UpstreamFailure, OSError) as exc:
            log.info("cancel of %s/%d got no acknowledgement: %r", request.request_id, request.attempt, exc)
            return None


class _StallWatch:
    """The stall deadline of an attempt's reads: one timer, moved only when it fires.

    ``reading(limit)`` starts a read that must end within ``limit`` seconds, and
    ``read_ended()`` ends it. When the timer finds the read in progress past its deadline
    it cancels the reading task; ``read_ended`` then says so (and takes the cancellation
    back) unless another cancel of the task came too, which then goes on as it would have.
    """

    LATE_S = 0.05  # a timer this late says the loop was busy: the read gets as long again

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.task: asyncio.Task[object] | None = None  # the task that reads (always the request loop's)
        self.since: float | None = None  # the read in progress began, on the loop's clock
        self.limit = 0.0
        self.cancelling = 0  # the reading task's cancel requests when the read began
        self.fired = False
        self.timer: asyncio.TimerHandle | None = None
        self.due = 0.0

    def reading(self, limit: float) -> None:
        now = self.loop.time()
        self.since, self.limit = now, limit
        if self.task is None:
            self.task = asyncio.current_task()
        assert self.task is not None
        self.cancelling = self.task.cancelling()
        if self.timer is None or self.due > now + limit:
            self._arm(now + limit)

    def read_ended(self) -> bool:
        """The read is over; whether this watch cancelled it (and only this watch)."""
        self.since = None
        if not self.fired:
            return False
        self.fired = False
        assert self.task is not None
        return self.task.uncancel() <= self.cancelling

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _arm(self, due: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.due = due
        self.timer = self.loop.call_at(due, self._check)

    def _check(self) -> None:
        self.timer = None
        now, since = self.loop.time(), self.since
        if since is None:  # between reads: the next read's deadline is at least this far
            self._arm(now + self.limit)
        elif since + self.limit > now:  # a later read than the one this timer was set for
            self._arm(since + self.limit)
        elif now - self.due > self.LATE_S:  # the loop ran late: unread frames may be waiting
            self._arm(now + (now - self.due))
        elif self.task is not None and not self.fired:
            self.fired = True
            self.task.cancel()
