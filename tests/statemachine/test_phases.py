"""The transition table, every pair of it, and the invariants apply() enforces."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from statemachine import events as ev
from statemachine.deltas import DeltaLogprobs
from statemachine.diagram import render_phases_markdown
from statemachine.errors import IllegalTransition
from statemachine.events import EVENT_TYPES, FailureKind, ReleaseReason
from statemachine.phases import TRANSITIONS, Phase, next_phase
from statemachine.policy_config import PolicyConfig
from statemachine.request_state import Outcome, RequestState
from statemachine.state import advance, apply, fold
from tests.statemachine.model import ModelDriver, accepted
from tests.statemachine.test_events import sample_event

ROOT = Path(__file__).resolve().parents[2]

LEGAL = {
    (Phase.NEW, "RequestAccepted"): Phase.PREFILL,
    **{
        (Phase.PREFILL, name): Phase.PREFILL
        for name in [
            "Decided",
            "AttemptStarted",
            "FirstTokenReceived",
            "ToolCallEmitted",
            "UpstreamFailed",
            "RetryBudgetDenied",
            "NoReplicaAvailable",
            "CancelSent",
            "CancelAcked",
            "LeaseExpired",
            "AttemptReleased",
            "ClientDisconnected",
            "ClientResumed",
            "ResumeGraceExpired",
            "RetryWaitElapsed",
            "DeltasProduced",
        ]
    },
    (Phase.PREFILL, "FirstDeltaCommitted"): Phase.DECODE,
    (Phase.PREFILL, "AttemptFenced"): Phase.FENCED,
    **{
        (Phase.DECODE, name): Phase.DECODE
        for name in [
            "Decided",
            "DeltasDelivered",
            "ToolCallEmitted",
            "UpstreamFailed",
            "CancelSent",
            "CancelAcked",
            "LeaseExpired",
            "AttemptReleased",
            "ClientDisconnected",
            "ClientResumed",
            "ResumeGraceExpired",
            "DeltasProduced",
        ]
    },
    (Phase.DECODE, "AttemptFenced"): Phase.FENCED,
    **{
        (Phase.FENCED, name): Phase.FENCED
        for name in [
            "Decided",
            "UpstreamFailed",
            "CancelSent",
            "CancelAcked",
            "LeaseExpired",
            "ClientDisconnected",
            "ClientResumed",
            "ResumeGraceExpired",
        ]
    },
    (Phase.FENCED, "AttemptReleased"): Phase.PREFILL,
    **{
        (Phase.TERMINATED, name): Phase.TERMINATED
        for name in ["CancelSent", "CancelAcked", "LeaseExpired", "AttemptReleased", "StreamResumed"]
    },
    **{
        (phase, name): Phase.TERMINATED
        for phase in (Phase.PREFILL, Phase.DECODE)
        for name in ("RequestCompleted", "RequestFailed", "RequestCancelled")
    },
    (Phase.FENCED, "RequestFailed"): Phase.TERMINATED,
    (Phase.FENCED, "RequestCancelled"): Phase.TERMINATED,
}

PAIRS = [(phase, name) for phase in Phase for name in sorted(EVENT_TYPES)]


@pytest.mark.parametrize(("phase", "type_name"), PAIRS, ids=[f"{p.value}-{n}" for p, n in PAIRS])
def test_every_pair_of_the_table(phase: Phase, type_name: str) -> None:
    event = sample_event(EVENT_TYPES[type_name], request_id="req_t")
    expected = LEGAL.get((phase, type_name))
    if expected is None:
        with pytest.raises(IllegalTransition) as caught:
            next_phase(phase, event)
        assert (caught.value.phase, caught.value.event_type, caught.value.request_id) == (
            phase.value,
            type_name,
            "req_t",
        )
        assert f"can't handle event {type_name} in phase {phase.value} (request req_t)" == str(caught.value)
    else:
        assert next_phase(phase, event) is expected


def test_the_expected_table_is_the_table() -> None:
    actual = {(phase, cls.__name__): target for phase, row in TRANSITIONS.items() for cls, target in row.items()}
    assert actual == LEGAL


def test_terminated_absorbs_all_but_bookkeeping() -> None:
    allowed = {cls.__name__ for cls in TRANSITIONS[Phase.TERMINATED]}
    assert allowed == {"CancelSent", "CancelAcked", "LeaseExpired", "AttemptReleased", "StreamResumed"}


def test_a_resumed_stream_names_deltas_that_were_delivered() -> None:
    driver = running()
    driver.deliver(3)
    driver.complete()
    resumed = next_event(driver, ev.StreamResumed, from_index=1, to_index=4, gateway="gw_a")
    assert_illegal(driver, resumed, r"deltas \[1, 4\) were never delivered")
    driver.state = apply(driver.state, next_event(driver, ev.StreamResumed, from_index=1, to_index=3, gateway="gw_a"))
    assert driver.state.phase is Phase.TERMINATED


def test_the_rendered_diagram_is_current() -> None:
    on_disk = (ROOT / "docs" / "phases.md").read_text()
    assert on_disk == render_phases_markdown(), "docs/phases.md is stale: run python ops/render_phases.py"


# --- invariants checked by apply() -----------------------------------------------------


def running(**kwargs: object) -> ModelDriver:
    driver = ModelDriver(**kwargs)  # type: ignore[arg-type]
    assert driver.state.current_attempt is not None
    return driver


def next_event(driver: ModelDriver, cls: type[ev.Event], **fields: object) -> ev.Event:
    seq = driver.state.seq + 1
    return cls(request_id=driver.request_id, seq=seq, occurred_at=driver.events[-1].occurred_at, **fields)  # type: ignore[arg-type]


def assert_illegal(driver: ModelDriver, event: ev.Event, why: str) -> None:
    with pytest.raises(IllegalTransition, match=why):
        apply(driver.state, event)


def test_events_must_follow_in_seq_order() -> None:
    driver = running()
    event = next_event(driver, ev.ClientDisconnected)
    assert_illegal(driver, dataclasses.replace(event, seq=event.seq + 1), "does not follow")
    assert_illegal(driver, dataclasses.replace(event, seq=event.seq - 1), "does not follow")


def test_events_of_another_request_are_refused() -> None:
    driver = running()
    event = dataclasses.replace(next_event(driver, ev.ClientDisconnected), request_id="req_other")
    assert_illegal(driver, event, "belongs to request req_other")


def test_a_second_attempt_cannot_start_while_the_first_is_live() -> None:
    driver = running()
    event = next_event(
        driver,
        ev.AttemptStarted,
        attempt=2,
        lease_epoch=9,
        replica_id="w2",
        lease_expires_at=driver.events[-1].occurred_at,
    )
    assert_illegal(driver, event, "attempt 1 is still live")


def test_attempt_numbers_and_epochs_must_grow() -> None:
    driver = running()
    driver.fail(FailureKind.REPLICA_EXITED)
    # the model started attempt 2 already; rebuild the state just before it
    before = fold(driver.events[: [type(e) for e in driver.events].index(ev.AttemptStarted, 3)])
    start = dict(replica_id="w2", lease_expires_at=driver.events[0].occurred_at, request_id=driver.request_id)
    seq = before.seq + 1
    with pytest.raises(IllegalTransition, match="is not attempt 2"):
        apply(before, ev.AttemptStarted(seq=seq, occurred_at=ev_time(driver), attempt=3, lease_epoch=5, **start))
    with pytest.raises(IllegalTransition, match="lease epoch does not increase"):
        apply(before, ev.AttemptStarted(seq=seq, occurred_at=ev_time(driver), attempt=2, lease_epoch=1, **start))


def ev_time(driver: ModelDriver):  # type: ignore[no-untyped-def]
    return driver.events[-1].occurred_at


def test_stale_lease_epochs_and_unknown_attempts_are_refused() -> None:
    driver = running()
    assert_illegal(
        driver, next_event(driver, ev.FirstTokenReceived, attempt=1, lease_epoch=7), "lease epoch 7 is not 1"
    )
    assert_illegal(driver, next_event(driver, ev.FirstTokenReceived, attempt=4, lease_epoch=1), "never started")


def test_only_the_committing_attempt_delivers_and_without_gaps() -> None:
    driver = running()
    driver.deliver(2)
    scope = driver.scoped()
    gap = next_event(
        driver, ev.DeltasDelivered, **scope, from_index=3, to_index=4, tokens=1, text="x", text_sha256=None
    )
    assert_illegal(driver, gap, r"deltas \[3, 4\) do not follow delta 2")
    empty = next_event(
        driver, ev.DeltasDelivered, **scope, from_index=2, to_index=2, tokens=0, text="", text_sha256=None
    )
    assert_illegal(driver, empty, "do not follow")
    negative = next_event(
        driver, ev.DeltasDelivered, **scope, from_index=2, to_index=3, tokens=-1, text="", text_sha256=None
    )
    assert_illegal(driver, negative, "negative token count")


@pytest.mark.parametrize(
    "deltas",
    [
        ((0, 2, 1),),  # one delta for two indexes
        ((0, 1, 1), (0, 1, 2)),  # three tokens, the event says two
        ((0, 1, 1), (1, 2, 1)),  # three characters, the text has two
    ],
)
def test_the_deltas_shapes_must_fit_the_batch(deltas: tuple[tuple[int, int, int], ...]) -> None:
    driver = running()
    driver.deliver(1)
    batch = next_event(
        driver,
        ev.DeltasDelivered,
        **driver.scoped(),
        from_index=1,
        to_index=3,
        tokens=2,
        text="ab",
        text_sha256=None,
        deltas=deltas,
    )
    assert_illegal(driver, batch, "the deltas' shapes disagree")
    fitting = next_event(
        driver,
        ev.DeltasDelivered,
        **driver.scoped(),
        from_index=1,
        to_index=3,
        tokens=2,
        text="ab",
        text_sha256=None,
        deltas=((0, 1, 1), (1, 1, 1)),
    )
    driver.state = apply(driver.state, fitting)
    assert driver.state.delivered_deltas == 3 and driver.state.delivered_output_tokens == 3


@pytest.mark.parametrize(
    ("fields", "legal"),
    [
        (("reasoning", "content"), True),
        (("", "content", "content"), True),  # a token with no text (vLLM's think end): no characters
        (("reasoning",), False),  # one key for three deltas
        (("reasoning", "", "content"), False),  # no field, yet characters
    ],
)
def test_each_deltas_field_fits_the_batch(fields: tuple[str, ...], legal: bool) -> None:
    driver = running()
    driver.deliver(1)
    deltas = ((0, 1, 1), (0, 1, 1)) if len(fields) == 2 else ((0, 0, 1), (0, 1, 1), (0, 1, 1))
    if fields == ("reasoning", "", "content"):
        deltas = ((0, 1, 1), (0, 1, 1), (0, 0, 1))
    batch = next_event(
        driver,
        ev.DeltasDelivered,
        **driver.scoped(),
        from_index=1,
        to_index=1 + len(deltas),
        tokens=len(deltas),
        text="ab",
        text_sha256=None,
        deltas=deltas,
        fields=fields,
    )
    if legal:
        driver.state = apply(driver.state, batch)
        assert driver.state.delivered_deltas == 1 + len(deltas)
    else:
        assert_illegal(driver, batch, "the deltas' keys disagree")


A_LOGPROB = ("a", -0.5, (("a", -0.5),))


@pytest.mark.parametrize(
    ("text", "logprobs"),
    [
        (None, ((A_LOGPROB,), (A_LOGPROB,))),  # kept without the text: the content policy broken
        ("ab", ((A_LOGPROB,),)),  # one entry for two deltas
    ],
)
def test_log_probabilities_come_with_the_text_one_entry_a_delta(text: str | None, logprobs: DeltaLogprobs) -> None:
    driver = running()
    driver.deliver(1)
    fields = {"from_index": 1, "to_index": 3, "tokens": 2, "text_sha256": None, "deltas": ((0, 1, 1), (0, 1, 1))}
    batch = next_event(driver, ev.DeltasDelivered, **driver.scoped(), **fields, text=text, logprobs=logprobs)
    assert_illegal(driver, batch, "log probabilities are kept with the text, one entry per delta")
    kept = next_event(driver, ev.DeltasDelivered, **driver.scoped(), **fields, text="ab", logprobs=((A_LOGPROB,), ()))
    driver.state = apply(driver.state, kept)
    assert driver.state.delivered_deltas == 3


@pytest.mark.parametrize(
    ("text", "more", "why"),
    [
        (None, {"token_ids": ((7,), (8,))}, "token ids are kept with the text, one entry per delta"),
        ("ab", {"token_ids": ((7,),)}, "token ids are kept with the text, one entry per delta"),
        (
            None,
            {"prompts": ((0, (1, 2), None),)},
            "a prompt's token ids and text are kept with the text, once per choice",
        ),
        ("ab", {"prompts": ((0, (1,), None), (0, (1,), None))}, "a prompt's token ids and text are kept with the text"),
    ],
)
def test_token_ids_and_the_prompts_fields_come_with_the_text(text: str | None, more: dict[str, Any], why: str) -> None:
    """Token ids are content (docs/design.md §13, §14): kept with the text, one entry a delta;
    what the replica said of a prompt, once a choice."""
    driver = running()
    driver.deliver(1)
    fields = {"from_index": 1, "to_index": 3, "tokens": 2, "text_sha256": None, "deltas": ((0, 1, 1), (1, 1, 1))}
    refused = next_event(driver, ev.DeltasDelivered, **driver.scoped(), **fields, text=text, **more)
    assert_illegal(driver, refused, why)
    both = {"token_ids": ((7,), ()), "prompts": ((0, (1, 2), "hi"), (1, None, "hi"))}
    kept = next_event(driver, ev.DeltasDelivered, **driver.scoped(), **fields, text="ab", **both)
    driver.state = apply(driver.state, kept)
    assert driver.state.delivered_deltas == 3


def test_a_fenced_attempt_publishes_nothing() -> None:
    driver = running()
    driver.fail(FailureKind.LIVENESS_UNCERTAIN)
    assert driver.state.phase is Phase.FENCED
    token = next_event(driver, ev.FirstTokenReceived, **driver.scoped())
    assert_illegal(driver, token, "can't handle event FirstTokenReceived in phase fenced")


def test_no_splice_a_retried_attempt_cannot_deliver_after_another_committed() -> None:
    driver = running()
    driver.deliver(1)
    state = dataclasses.replace(driver.state, first_delta_attempt=9)  # pretend another attempt committed
    event = next_event(
        driver,
        ev.DeltasDelivered,
        **driver.scoped(),
        from_index=1,
        to_index=2,
        tokens=1,
        text="y",
        text_sha256=None,
    )
    with pytest.raises(IllegalTransition, match="did not commit the first delta"):
        apply(state, event)


def test_failures_name_the_running_attempt() -> None:
    driver = running()
    driver.fail(FailureKind.REPLICA_EXITED)  # attempt 1 dead, attempt 2 running
    stale = next_event(driver, ev.UpstreamFailed, attempt=1, lease_epoch=1, kind=FailureKind.REPLICA_EXITED, detail="x")
    assert_illegal(driver, stale, "attempt 1 is not the running attempt")


def test_cancel_ack_needs_a_cancel_and_release_needs_its_cause() -> None:
    driver = running()
    scope = driver.scoped()
    assert_illegal(driver, next_event(driver, ev.CancelAcked, **scope, generated_tokens=1), "no cancel was sent")
    released = next_event(driver, ev.AttemptReleased, **scope, because=ReleaseReason.CANCEL_ACKED)
    assert_illegal(driver, released, "cancel ack that was not recorded")
    released = next_event(driver, ev.AttemptReleased, **scope, because=ReleaseReason.LEASE_EXPIRED)
    assert_illegal(driver, released, "lease expiry that was not recorded")


def test_an_attempt_is_released_once() -> None:
    driver = running()
    driver.fail(FailureKind.LIVENESS_UNCERTAIN)
    driver.lease_expires()  # released; attempt 2 started
    again = next_event(driver, ev.LeaseExpired, attempt=1, lease_epoch=1)
    assert_illegal(driver, again, "already released")


def test_a_fenced_attempt_of_a_delivered_request_never_reopens_prefill() -> None:
    driver = running()
    driver.deliver(1)
    scope = driver.scoped()
    driver.record(ev.AttemptFenced, **scope, waiting_for="cancel_ack_or_lease_expiry")
    driver.record(ev.LeaseExpired, **scope)
    release = next_event(driver, ev.AttemptReleased, **scope, because=ReleaseReason.LEASE_EXPIRED)
    assert_illegal(driver, release, "only the fenced attempt of an undelivered request reopens prefill")


def test_client_disconnects_once() -> None:
    driver = running()
    driver.record(ev.ClientDisconnected)
    assert_illegal(driver, next_event(driver, ev.ClientDisconnected), "already disconnected")


def test_terminal_bodies_must_agree_with_the_log() -> None:
    driver = running()
    driver.deliver(3)
    wrong_count = next_event(
        driver,
        ev.RequestFailed,
        code="x",
        message="m",
        partial_output=True,
        delivered_output_tokens=2,
        retryable=False,
    )
    assert_illegal(driver, wrong_count, "delivered_output_tokens disagrees")
    wrong_partial = next_event(
        driver,
        ev.RequestFailed,
        code="x",
        message="m",
        partial_output=False,
        delivered_output_tokens=3,
        retryable=False,
    )
    assert_illegal(driver, wrong_partial, "partial_output disagrees")


def test_completion_needs_a_running_attempt() -> None:
    state = fold([accepted()])
    done = ev.RequestCompleted("req_model", 2, accepted().occurred_at, "stop", {})
    with pytest.raises(IllegalTransition, match="no running attempt"):
        apply(state, done)


def test_tool_call_keys_are_request_and_call_ids() -> None:
    driver = running()
    bad = next_event(
        driver,
        ev.ToolCallEmitted,
        **driver.scoped(),
        index=0,
        tool_call_id="c1",
        name="f",
        arguments="{}",
        idempotency_key="c1",
    )
    assert_illegal(driver, bad, "idempotency key")


def test_refused_starts_need_a_decided_start() -> None:
    driver = running()
    assert_illegal(driver, next_event(driver, ev.RetryBudgetDenied, scope="global"), "no attempt start was decided")


def test_accepted_budget_must_be_positive() -> None:
    with pytest.raises(IllegalTransition, match="at least 1"):
        fold([accepted(max_attempts=0)])


def test_fold_needs_something_to_fold() -> None:
    with pytest.raises(ValueError, match="at least one event"):
        fold([])
    start = RequestState(request_id="req_model")
    assert fold([], start) is start


def test_a_completed_request_records_its_outcome_and_attempt_ends() -> None:
    driver = running()
    driver.deliver(2)
    driver.complete()
    state = driver.state
    assert (state.phase, state.outcome, state.finish_reason) == (Phase.TERMINATED, Outcome.COMPLETED, "stop")
    assert state.current_attempt is not None and state.current_attempt.ended == "completed"
    assert state.delivered_output_tokens == 2 and state.retry_budget_left == 1
    assert state.attempt(0) is None and state.attempt(2) is None


def test_an_old_attempt_cannot_publish_after_a_retry() -> None:
    driver = running()
    driver.fail(FailureKind.REPLICA_EXITED)
    assert_illegal(driver, next_event(driver, ev.FirstTokenReceived, attempt=1, lease_epoch=1), "not the live attempt")


def test_attempts_say_how_they_ended() -> None:
    driver = running(config=PolicyConfig(max_attempts=3))
    driver.fail(FailureKind.REJECTED)
    driver.fail(FailureKind.LIVENESS_UNCERTAIN)
    driver.lease_expires()
    ends = [attempt.ended for attempt in driver.state.attempts]
    assert ends == ["rejected", "lease_expired", None]
    assert [attempt.replica_id for attempt in driver.state.attempts] == ["w1", "w2", "w3"]


# --- what a log may not say (trace import refuses what the fold refuses) ------------------


def test_time_never_goes_back_and_advance_stamps_a_stepped_back_clock_with_the_last_time() -> None:
    driver = running()
    last = driver.events[-1].occurred_at
    earlier = dataclasses.replace(next_event(driver, ev.ClientDisconnected), occurred_at=last - timedelta(seconds=1))
    assert_illegal(driver, earlier, "time goes back")
    state, event = advance(driver.state, ev.ClientDisconnected, last - timedelta(seconds=1))
    assert event.occurred_at == last and state.last_occurred_at == last
    later = last + timedelta(seconds=1)
    assert advance(driver.state, ev.ClientDisconnected, later)[1].occurred_at == later


def test_a_lease_epoch_is_never_negative() -> None:
    driver = ModelDriver(replicas=())  # no replica: the first start is refused, no attempt yet
    driver.state = RequestState(request_id=driver.request_id)
    for event in driver.events[:2]:  # accepted, start decided
        driver.state = apply(driver.state, event)
    start = next_event(
        driver,
        ev.AttemptStarted,
        attempt=1,
        lease_epoch=-1,
        replica_id="w1",
        lease_expires_at=driver.events[-1].occurred_at,
    )
    assert_illegal(driver, start, "negative lease epoch -1")


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"finish_reason": "finished"}, "unknown finish reason 'finished'"),
        ({"finish_reasons": ("stop", "eos")}, "unknown finish reason 'eos'"),
        ({"usage": {"completion_tokens": -1}}, "negative usage count"),
    ],
)
def test_a_completion_says_a_known_finish_reason_and_counts_no_less_than_zero(
    fields: dict[str, object], why: str
) -> None:
    driver = running()
    driver.first_token()
    driver.deliver(1)
    values: dict[str, object] = {"finish_reason": "stop", "usage": {"completion_tokens": 1}, **fields}
    assert_illegal(driver, next_event(driver, ev.RequestCompleted, **values), why)
    known = {"finish_reason": "length", "usage": {}, "finish_reasons": ("length",)}
    driver.state = apply(driver.state, next_event(driver, ev.RequestCompleted, **known))


def test_a_cancel_ack_counts_no_less_than_zero() -> None:
    driver = running()
    driver.client_gone()
    ack = next_event(driver, ev.CancelAcked, **driver.scoped(), generated_tokens=-3)
    assert_illegal(driver, ack, "negative generated token count")
