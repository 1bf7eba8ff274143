"""The disconnect grace (docs/design.md §12), in the pure core: a client that leaves starts
``resume_grace_s``; the policy cancels only when it runs out with no client attached;
output produced meanwhile is recorded as produced, and delivered only when a client
receives it."""

from __future__ import annotations

import pytest

from statemachine import events as ev
from statemachine.actions import CancelAttempt, CancelRequest, FailRequest, StartAttempt
from statemachine.errors import IllegalTransition
from statemachine.events import FailureKind
from statemachine.phases import Phase
from statemachine.request_state import Outcome
from statemachine.state import advance
from tests.statemachine.model import ModelDriver


def running() -> ModelDriver:
    driver = ModelDriver()
    driver.first_token()
    return driver


def illegal(driver: ModelDriver, cls: type[ev.Event], why: str, **fields: object) -> None:
    with pytest.raises(IllegalTransition, match=why):
        advance(driver.state, cls, driver.events[-1].occurred_at, **fields)


def test_with_no_grace_the_client_leaving_cancels_at_once() -> None:
    driver = running()
    driver.deliver(2)
    actions = driver.client_gone(resume_grace_s=0.0)
    assert [type(a) for a in actions] == [CancelAttempt, CancelRequest]
    assert driver.state.outcome is Outcome.CANCELLED


def test_within_the_grace_nothing_is_decided_and_produced_output_is_not_delivered() -> None:
    driver = running()
    driver.deliver(2)
    assert driver.client_gone(resume_grace_s=10.0) == []
    driver.produce(3)
    state = driver.state
    assert (state.delivered_deltas, state.produced_deltas, state.delivered_output_tokens) == (2, 5, 2)
    assert state.phase is Phase.DECODE and state.outcome is None


def test_the_grace_expiring_cancels_upstream_and_the_request() -> None:
    driver = running()
    driver.deliver(1)
    driver.client_gone(resume_grace_s=10.0)
    driver.produce(2)
    actions = driver.grace_expires()
    assert [(type(a), a.reason) for a in actions] == [(CancelAttempt, "client_gone"), (CancelRequest, "client_gone")]
    assert driver.state.outcome is Outcome.CANCELLED
    assert driver.state.delivered_output_tokens == 1


def test_a_resumed_client_receives_the_produced_deltas_as_deliveries() -> None:
    driver = running()
    driver.deliver(2)
    driver.client_gone(resume_grace_s=10.0)
    driver.produce(3)
    assert driver.client_resumes(after=1) == []
    driver.deliver(4)  # 3 produced ones, then a new one
    state = driver.state
    assert (state.delivered_deltas, state.produced_deltas, state.client_gone) == (6, 6, False)
    driver.complete()
    assert driver.state.outcome is Outcome.COMPLETED


def test_the_commit_point_is_the_first_delta_a_client_receives() -> None:
    driver = running()
    driver.client_gone(resume_grace_s=10.0)  # before the first delta
    driver.produce(2)
    assert driver.state.phase is Phase.PREFILL and not driver.state.first_delta_sent
    driver.client_resumes()
    driver.deliver(2)
    assert driver.state.first_delta_sent and driver.state.phase is Phase.DECODE


def test_a_failure_while_unattached_before_any_delivery_is_retried_from_scratch() -> None:
    driver = running()
    driver.client_gone(resume_grace_s=10.0)
    driver.produce(2)
    actions = driver.fail(FailureKind.REPLICA_EXITED)
    assert [type(a) for a in actions] == [StartAttempt]
    assert driver.state.produced_deltas == 0  # the retry's deltas are numbered from 0


def test_a_failure_while_unattached_after_delivery_is_decode_interrupted() -> None:
    driver = running()
    driver.deliver(2)
    driver.client_gone(resume_grace_s=10.0)
    driver.produce(1)
    actions = driver.fail(FailureKind.REPLICA_EXITED)
    (failed,) = [a for a in actions if isinstance(a, FailRequest)]
    assert failed.code == "upstream_decode_interrupted" and failed.delivered_output_tokens == 2


def test_produced_output_needs_a_client_gone_and_follows_the_log() -> None:
    driver = running()
    driver.deliver(1)
    scope = driver.scoped()
    shape = {"tokens": 1, "text": "x", "text_sha256": None}
    illegal(driver, ev.DeltasProduced, "no client is attached", **scope, from_index=1, to_index=2, **shape)
    driver.client_gone(resume_grace_s=5.0)
    illegal(driver, ev.DeltasProduced, "do not follow delta 1", **scope, from_index=2, to_index=3, **shape)


def test_a_resume_needs_a_running_grace() -> None:
    driver = running()
    illegal(driver, ev.ClientResumed, "no client left", after=-1, gateway="g")
    illegal(driver, ev.ResumeGraceExpired, "no resume grace is running")
    driver.client_gone(resume_grace_s=5.0)
    illegal(driver, ev.ClientResumed, "after is a delta index", after=-2, gateway="g")
    illegal(driver, ev.ClientDisconnected, "already disconnected", resume_grace_s=1.0)
    driver.record(ev.ResumeGraceExpired)
    illegal(driver, ev.ResumeGraceExpired, "no resume grace is running")


def test_a_grace_is_never_negative() -> None:
    illegal(running(), ev.ClientDisconnected, "negative resume grace", resume_grace_s=-1.0)


def test_a_second_disconnect_after_a_resume_starts_a_new_grace() -> None:
    driver = running()
    driver.deliver(1)
    driver.client_gone(resume_grace_s=5.0)
    driver.client_resumes(after=0)
    assert driver.client_gone(resume_grace_s=5.0) == []
    assert driver.grace_expires()[-1] == CancelRequest("client_gone")


def test_the_resumed_stream_may_be_recorded_up_to_the_produced_deltas() -> None:
    driver = running()
    driver.deliver(1)
    driver.client_gone(resume_grace_s=5.0)
    driver.produce(2)
    driver.complete()
    driver.record(ev.StreamResumed, from_index=1, to_index=3, gateway="g")
    illegal(driver, ev.StreamResumed, "never delivered", from_index=1, to_index=4, gateway="g")


# --- background responses (docs/design.md §15): no grace runs out for want of a client ---------


def test_a_whole_background_response_has_no_client_from_its_accept_and_is_never_cancelled_for_it() -> None:
    driver = ModelDriver(background=True, stream=False)
    assert driver.state.background and driver.state.client_gone
    driver.first_token()
    driver.produce(3)  # nobody attached: produced, and nothing decided
    assert driver.step() == [] and driver.state.outcome is None and not driver.state.first_delta_sent
    illegal(driver, ev.ResumeGraceExpired, "no resume grace is running")
    driver.complete()
    assert driver.state.outcome is Outcome.COMPLETED and driver.state.delivered_deltas == 0


def test_a_background_reader_attaches_leaves_and_attaches_again_whatever_the_grace() -> None:
    driver = ModelDriver(background=True, stream=False)
    driver.first_token()
    driver.produce(2)
    assert driver.client_resumes(after=-1) == []  # a reader, from the start
    driver.deliver(3)  # its first delta is the commit point
    assert driver.state.first_delta_sent and driver.state.delivered_deltas == 3
    assert driver.client_gone(resume_grace_s=0.0) == []  # no grace, and still not cancelled
    driver.produce(1)
    assert driver.client_resumes(after=2) == []
    driver.deliver(1)
    driver.complete()
    assert driver.state.outcome is Outcome.COMPLETED


def test_a_streamed_background_response_is_read_by_its_post_and_outlives_its_leaving() -> None:
    driver = ModelDriver(background=True, stream=True)
    assert driver.state.background and not driver.state.client_gone
    driver.first_token()
    driver.deliver(2)
    assert driver.client_gone(resume_grace_s=0.0) == []
    illegal(driver, ev.ResumeGraceExpired, "no resume grace is running")
    driver.produce(1)
    assert driver.state.outcome is None


def test_a_background_response_failing_unread_is_retried_and_read_is_decode_interrupted() -> None:
    unread = ModelDriver(background=True, stream=False)
    unread.first_token()
    unread.produce(2)
    assert [type(a) for a in unread.fail(FailureKind.REPLICA_EXITED)] == [StartAttempt]
    read = ModelDriver(background=True, stream=False)
    read.first_token()
    read.client_resumes()
    read.deliver(2)
    (failed,) = [a for a in read.fail(FailureKind.REPLICA_EXITED) if isinstance(a, FailRequest)]
    assert failed.code == "upstream_decode_interrupted" and failed.delivered_output_tokens == 2
