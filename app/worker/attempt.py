"""Attempts and their leases, as the worker holds them.

The table answers the fencing questions without I/O: may this start go ahead (not a
duplicate, not cancelled before it arrived, not older than an epoch already seen for
its request), which older attempts of the same request must be revoked, and which
attempt a renew or cancel names. Finished attempts and cancel tombstones are kept for
``retain_s`` so that a late cancel is still answered truthfully.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from typing import TYPE_CHECKING

from app.contract.worker_protocol import RENEWAL_SLACK
from app.worker.lease_calls import AttemptRef
from app.worker.protocol import AttemptSpec, Code, Refusal

if TYPE_CHECKING:
    from app.worker.engine import Prepared
    from app.worker.faults import Fault


class Stop(enum.StrEnum):
    """Why the worker stopped publishing for an attempt before it finished."""

    CANCELLED = "cancelled"
    LEASE_EXPIRED = "lease_expired"
    REVOKED = "lease_revoked"  # a start with a newer epoch for the same request arrived
    REPLICA_EXITING = "replica_exiting"  # the drain's grace period ran out
    DISCONNECTED = "disconnected"  # the stream's reader went away
    ENGINE_ERROR = "engine_error"
    FAULT = "fault"  # an injected fault ended the stream


_engine_ids = itertools.count(1)


class Attempt:
    """One attempt on this worker: its lease, phase, counts and the signals around it."""

    __slots__ = (
        "counts_due",
        "created_at",
        "engine_generated",
        "engine_over",
        "engine_request_id",
        "engine_started",
        "expires_at",
        "fault",
        "finished_at",
        "generated_tokens",
        "has_slot",
        "last_frame_at",
        "lease_epoch",
        "phase",
        "prepared",
        "published_tokens",
        "released",
        "renewals_read",
        "slot",
        "spec",
        "stop",
        "stop_signal",
        "stopped_at",
        "timer",
    )

    def __init__(self, spec: AttemptSpec, prepared: Prepared, fault: Fault | None, now: float) -> None:
        loop = asyncio.get_running_loop()
        self.spec = spec
        self.prepared = prepared
        self.fault = fault
        self.lease_epoch = spec.lease_epoch
        self.engine_request_id = f"{spec.request_id}/{spec.attempt}#{next(_engine_ids)}"
        self.created_at = now
        self.expires_at = now + spec.lease_ttl_s
        self.renewals_read = {0: now}  # renewal number -> when it was read (0: the start)
        # the choices whose first text is still to say the prompt's token count, where the
        # client asked for the usage in every chunk (docs/worker-protocol.md); None: not asked
        self.counts_due = set(range(spec.choices)) if spec.continuous_usage else None
        self.timer: asyncio.TimerHandle | None = None
        self.phase = "queued"  # queued -> prefill -> decode -> done
        self.stop: Stop | None = None
        self.stop_signal: asyncio.Future[None] = loop.create_future()
        self.slot: asyncio.Future[None] = loop.create_future()
        self.has_slot = False
        self.released = False
        self.engine_started = False
        self.engine_over = asyncio.Event()  # the engine finished the request or confirmed its abort
        # Fixed when the engine confirms an abort: its own count where it keeps one (sim), else
        # what the worker had received (vllm: a last delta may still wait in vLLM's queue).
        self.engine_generated: int | None = None
        self.generated_tokens = 0  # tokens the worker received from the engine
        self.published_tokens = 0
        self.finished_at: float | None = None
        # when the last token or tool_call frame passed its lease check
        self.last_frame_at: float | None = None
        self.stopped_at: float | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.spec.request_id, self.spec.attempt)

    @property
    def live(self) -> bool:
        return self.stop is None and self.phase != "done"

    def renewed_until(self, ref: AttemptRef, now: float) -> float:
        """Where a renewal read ``now`` moves the lease's end: ``ref.lease_ttl_s`` from now,
        but no further than :data:`RENEWAL_SLACK` TTLs past the TTL of the last renewal
        whose answer the gateway got (``ref.answered``; 0: the start), and never back. So
        the worker's lease never outlasts the gateway's view of it, which runs from when
        that answer came: a renewal read here whose answer a cut lost moves it no further
        than the gateway counts on (app/replicas/renewer.py). A renewal by hand (no
        number) extends it from now, as asked."""
        assert ref.lease_ttl_s is not None
        wanted = now + ref.lease_ttl_s
        if ref.renewal is None or ref.answered is None:
            return wanted
        reads = self.renewals_read
        reads[ref.renewal] = now
        base = reads.get(ref.answered)
        for older in [n for n in reads if n < ref.answered]:  # the gateway names none of them again
            del reads[older]
        if base is None:  # one this worker never read: no further than it stands
            return self.expires_at
        return max(self.expires_at, min(wanted, base + ref.lease_ttl_s * (1 + RENEWAL_SLACK)))

    def generated(self) -> int:
        """Tokens generated for this attempt: once an abort is confirmed, the count fixed then."""
        return self.generated_tokens if self.engine_generated is None else self.engine_generated

    def describe(self, now: float) -> dict[str, object]:
        def since_created(at: float | None) -> int | None:
            return None if at is None else round((at - self.created_at) * 1000)

        return {
            "request_id": self.spec.request_id,
            "attempt": self.spec.attempt,
            "lease_epoch": self.lease_epoch,
            "phase": self.phase,
            "stop": None if self.stop is None else self.stop.value,
            "lease_remaining_ms": round((self.expires_at - now) * 1000),
            "engine_over": self.engine_over.is_set(),
            "generated_tokens": self.generated(),
            "published_tokens": self.published_tokens,
            "fault": None if self.fault is None else self.fault.id,
            # the attempt's timeline on the worker's clock, in ms since it was admitted
            "lease_ends_ms": since_created(self.expires_at),
            "last_frame_ms": since_created(self.last_frame_at),
            "stopped_ms": since_created(self.stopped_at),
        }


class AttemptTable:
    """Every attempt this worker knows, plus what fencing needs to remember."""

    def __init__(self, retain_s: float) -> None:
        self.retain_s = retain_s
        self.attempts: dict[tuple[str, int], Attempt] = {}
        self._epochs: dict[str, tuple[int, float]] = {}  # request_id -> (highest epoch, seen at)
        self._tombstones: dict[tuple[str, int], float] = {}  # cancelled before they started

    def check_start(self, spec: AttemptSpec, now: float) -> list[Attempt]:
        """Refuse a start that fencing forbids; else the older live attempts it revokes."""
        key = (spec.request_id, spec.attempt)
        if key in self.attempts:
            raise Refusal(409, Code.DUPLICATE_ATTEMPT, f"attempt {spec.attempt} of {spec.request_id} already exists")
        if key in self._tombstones:
            raise Refusal(409, Code.ATTEMPT_CANCELLED, f"attempt {spec.attempt} was cancelled before it started")
        highest = self._epochs.get(spec.request_id, (-1, 0.0))[0]
        if spec.lease_epoch < highest:
            raise Refusal(
                409,
                Code.STALE_LEASE_EPOCH,
                f"lease epoch {spec.lease_epoch} is older than epoch {highest} already seen for {spec.request_id}",
                field="lease_epoch",
            )
        return [
            a
            for a in self.attempts.values()
            if a.live and a.spec.request_id == spec.request_id and a.lease_epoch < spec.lease_epoch
        ]

    def add(self, attempt: Attempt, now: float) -> None:
        self.attempts[attempt.key] = attempt
        self._epochs[attempt.spec.request_id] = (attempt.lease_epoch, now)

    def find(self, ref: AttemptRef) -> Attempt | None:
        """The attempt a renew or cancel names; a stale epoch is refused."""
        attempt = self.attempts.get((ref.request_id, ref.attempt))
        if attempt is not None and attempt.lease_epoch != ref.lease_epoch:
            raise Refusal(
                409,
                Code.STALE_LEASE_EPOCH,
                f"attempt {ref.attempt} of {ref.request_id} holds lease epoch {attempt.lease_epoch}, "
                f"not {ref.lease_epoch}",
                field="lease_epoch",
            )
        return attempt

    def tombstone(self, ref: AttemptRef, now: float) -> None:
        self._tombstones[(ref.request_id, ref.attempt)] = now

    def live(self) -> list[Attempt]:
        return [a for a in self.attempts.values() if a.live]

    def prune(self, now: float) -> None:
        horizon = now - self.retain_s
        for key, attempt in list(self.attempts.items()):
            if attempt.finished_at is not None and attempt.finished_at < horizon:
                del self.attempts[key]
        for key, at in list(self._tombstones.items()):
            if at < horizon:
                del self._tombstones[key]
        live_requests = {a.spec.request_id for a in self.attempts.values()}
        for request_id, (_, seen) in list(self._epochs.items()):
            if seen < horizon and request_id not in live_requests:
                del self._epochs[request_id]
