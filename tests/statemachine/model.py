"""A pure model of the request driver, for tests: it observes, decides and acts.

The real driver (``app/driver``) talks to replicas and the store. This model does
what it does to the log and nothing else: observations are recorded as events,
``decide()`` is asked after each, its actions are recorded as ``Decided`` events and
carried out by recording the events a driver would record. Time is a counter.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

from statemachine import events as ev
from statemachine.actions import (
    CancelAttempt,
    CancelRequest,
    FailRequest,
    FenceAttempt,
    StartAttempt,
    Wait,
    WaitToRetry,
)
from statemachine.events import Event, FailureKind
from statemachine.phases import Phase
from statemachine.policy import decide, decided_fields, needs_pool
from statemachine.policy_config import PolicyConfig
from statemachine.request_state import DEAD_KINDS, RequestState
from statemachine.routing import PoolSnapshot, ReplicaView
from statemachine.state import advance

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def accepted(request_id: str = "req_model", seq: int = 1, **overrides: Any) -> ev.RequestAccepted:
    fields: dict[str, Any] = {
        "request_id": request_id,
        "seq": seq,
        "occurred_at": T0,
        "model": "tiny",
        "model_revision": "rev1",
        "tenant": "default",
        "endpoint": "chat.completions",
        "stream": True,
        "params_digest": "sha256:0",
        "prompt_tokens": 12,
        "n": 1,
        "guided": False,
        "tools": False,
        "idempotency_key": None,
        "max_attempts": 2,
        "seed": 7,
    }
    fields.update(overrides)
    return ev.RequestAccepted(**fields)


class ModelDriver:
    """Drives one request through the pure core the way the gateway does."""

    def __init__(
        self,
        request_id: str = "req_model",
        config: PolicyConfig | None = None,
        replicas: tuple[str, ...] = ("w1", "w2", "w3"),
        global_budget: int = 100,
        acknowledges_cancel: bool = True,
        aborts_on_close: bool = False,
        pool: PoolSnapshot | None = None,
        **accepted_overrides: Any,
    ) -> None:
        self.config = config or PolicyConfig()
        self.acknowledges_cancel = acknowledges_cancel  # the replicas' kind: a worker, or a plain OpenAI server
        self.aborts_on_close = aborts_on_close  # a plain OpenAI server: closing the connection aborts
        self.replicas = replicas
        # what the pool looks like to the policy: every replica available and idle (tests may change it)
        self.pool = pool or PoolSnapshot(tuple(ReplicaView(replica) for replica in replicas))
        self.global_budget = global_budget
        self.events: list[Event] = []
        self.state = RequestState(request_id=request_id)
        self.epoch = 0
        self.next_token = 0
        self.record(ev.RequestAccepted, **_accepted_fields(accepted_overrides, self.config))
        self.step()

    # --- the log -----------------------------------------------------------------

    @property
    def request_id(self) -> str:
        return self.state.request_id

    def record(self, cls: type[Event], **fields: Any) -> Event:
        at = T0 + timedelta(milliseconds=self.state.seq + 1)
        self.state, event = advance(self.state, cls, at, **fields)
        self.events.append(event)
        return event

    def scoped(self, attempt: int | None = None) -> dict[str, int]:
        current = self.state.attempt(attempt) if attempt else self.state.current_attempt
        assert current is not None
        return {"attempt": current.attempt, "lease_epoch": current.lease_epoch}

    # --- decide and act ----------------------------------------------------------

    def step(self) -> list[Any]:
        """Ask the policy, record its decisions, carry them out; repeat until quiet."""
        taken: list[Any] = []
        while True:
            actions = decide(self.state, self.config, self.pool if needs_pool(self.state) else None)
            if not actions:
                return taken
            for action in actions:
                self.record(ev.Decided, **decided_fields(action))
            for action in actions:
                self.act(action)
            taken.extend(actions)
            if all(isinstance(action, Wait) for action in actions):
                return taken

    def act(self, action: Any) -> None:
        if isinstance(action, StartAttempt):
            if action.attempt > 1 and self.global_budget <= 0:
                self.record(ev.RetryBudgetDenied, scope="global")
            elif action.replica is None:
                self.record(ev.NoReplicaAvailable, excluded=action.exclude_replicas, detail="none healthy")
            else:
                if action.attempt > 1:
                    self.global_budget -= 1
                self.epoch += 1
                self.record(
                    ev.AttemptStarted,
                    attempt=action.attempt,
                    lease_epoch=self.epoch,
                    replica_id=action.replica,
                    lease_expires_at=T0 + timedelta(seconds=5),
                    acknowledges_cancel=self.acknowledges_cancel,
                    aborts_on_close=self.aborts_on_close,
                    model=None if action.model == self.state.model else action.model,
                )
                self.pool = dataclasses.replace(self.pool, placements=self.pool.placements + 1)
        elif isinstance(action, WaitToRetry):
            self.record(ev.RetryWaitElapsed, replica_id=action.replica)  # the timer, at once
        elif isinstance(action, FenceAttempt):
            self.record(ev.AttemptFenced, **self.scoped(action.attempt), waiting_for=action.wait_for)
            self.record(ev.CancelSent, **self.scoped(action.attempt))
        elif isinstance(action, CancelAttempt):
            self.record(ev.CancelSent, **self.scoped(action.attempt))
        elif isinstance(action, FailRequest):
            self.record(
                ev.RequestFailed,
                code=action.code,
                message=action.message,
                partial_output=action.partial_output,
                delivered_output_tokens=action.delivered_output_tokens,
                retryable=action.retryable,
            )
        elif isinstance(action, CancelRequest):
            self.record(ev.RequestCancelled, reason=action.reason)

    # --- observations ------------------------------------------------------------

    def first_token(self) -> None:
        self.record(ev.FirstTokenReceived, **self.scoped())
        self.step()

    def deliver(self, tokens: int = 1, text: str = "x") -> None:
        """Deliver ``tokens`` one-token deltas (committing the first delta if needed)."""
        if not self.state.first_delta_sent:
            self.record(ev.FirstDeltaCommitted, **self.scoped())
        start = self.state.delivered_deltas
        self.record(
            ev.DeltasDelivered,
            **self.scoped(),
            from_index=start,
            to_index=start + tokens,
            tokens=tokens,
            text=text * tokens,
            text_sha256=None,
            deltas=((0, len(text), 1),) * tokens,  # one token a delta, as the gateway records its shapes
        )
        self.step()

    def tool_call(self, index: int = 0, tool_call_id: str = "call_0") -> None:
        self.record(
            ev.ToolCallEmitted,
            **self.scoped(),
            index=index,
            tool_call_id=tool_call_id,
            name="lookup",
            arguments="{}",
            idempotency_key=f"{self.request_id}:{tool_call_id}",
        )
        self.step()

    def fail(self, kind: FailureKind, deadline: ev.Deadline | None = None, **extra: Any) -> list[Any]:
        fenced = self.state.phase is Phase.FENCED
        self.record(
            ev.UpstreamFailed,
            **self.scoped(),
            kind=kind,
            detail=f"{kind.value} observed",
            deadline=deadline,
            **extra,
        )
        if fenced and kind in DEAD_KINDS:  # the fenced attempt died: that releases it
            self.record(ev.AttemptReleased, **self.scoped(), because=ev.ReleaseReason.REPLICA_EXITED)
        return self.step()

    def ack(self) -> None:
        self.record(ev.CancelAcked, **self.scoped(), generated_tokens=3)
        self.record(ev.AttemptReleased, **self.scoped(), because=ev.ReleaseReason.CANCEL_ACKED)
        self.step()

    def lease_expires(self) -> None:
        self.record(ev.LeaseExpired, **self.scoped())
        self.record(ev.AttemptReleased, **self.scoped(), because=ev.ReleaseReason.LEASE_EXPIRED)
        self.step()

    def connection_closed(self) -> None:
        """The driver closed the fenced attempt's stream (a replica that aborts on it)."""
        self.record(ev.AttemptReleased, **self.scoped(), because=ev.ReleaseReason.CONNECTION_CLOSED)
        self.step()

    def client_gone(self, resume_grace_s: float = 0.0) -> list[Any]:
        self.record(ev.ClientDisconnected, resume_grace_s=resume_grace_s)
        return self.step()

    def produce(self, tokens: int = 1, text: str = "x") -> None:
        """``tokens`` one-token deltas produced while no client is attached."""
        start = self.state.produced_deltas
        self.record(
            ev.DeltasProduced,
            **self.scoped(),
            from_index=start,
            to_index=start + tokens,
            tokens=tokens,
            text=text * tokens,
            text_sha256=None,
        )
        self.step()

    def client_resumes(self, after: int = -1) -> list[Any]:
        self.record(ev.ClientResumed, after=after, gateway="gw_a")
        return self.step()

    def grace_expires(self) -> list[Any]:
        self.record(ev.ResumeGraceExpired)
        return self.step()

    def complete(self) -> None:
        self.record(ev.RequestCompleted, finish_reason="stop", usage={"prompt_tokens": 12, "completion_tokens": 4})
        self.step()


def _accepted_fields(overrides: dict[str, Any], config: PolicyConfig) -> dict[str, Any]:
    template = accepted(max_attempts=config.max_attempts, **overrides)
    return {
        f.name: getattr(template, f.name)
        for f in dataclasses.fields(template)
        if f.name not in ("request_id", "seq", "occurred_at")
    }
