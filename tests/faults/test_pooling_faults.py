"""Faults during a pooling request (docs/design.md §17), judged by what the client got and
what the log says: a real gateway in front of two scripted OpenAI-compatible upstreams, each
a process of its own (their pooling answers are the sim engine's vectors), the real
``openai`` client, and the log read back from PostgreSQL and replayed.

A pooling request has no decode: its commit point is its answer, so a replica that dies
while it computes it is retried on the other and the client gets one answer; a retry is
still bounded by the cost guard and the budgets (docs/design.md §5).
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from app.config import ReplicaConfig
from app.worker import sim_pooling
from statemachine import events as ev
from statemachine.events import FailureKind
from statemachine.policy_config import PolicyConfig
from statemachine.replay import replay
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.scripted_upstream import ScriptedUpstream, running_scripted_upstream
from tests.support.transcript import of


@pytest.fixture
def upstreams() -> Iterator[list[ScriptedUpstream]]:
    """Two upstreams of their own: a test kills one."""
    with running_scripted_upstream() as first, running_scripted_upstream() as second:
        yield [first, second]


def gateway_over(database_url: str, upstreams: list[ScriptedUpstream], **settings: object) -> Iterator[RunningGateway]:
    replicas = [ReplicaConfig(id=f"u{n}", url=u.base_url, kind="openai") for n, u in enumerate(upstreams, 1)]
    return running_gateway(database_url, replicas, health_interval_s=30, **settings)  # type: ignore[return-value]


def judged(gateway: RunningGateway, request_id: str, policy: PolicyConfig | None = None) -> list[ev.Event]:
    gateway.wait_logged(request_id, lambda events: fold(events).outcome is not None)
    events = gateway.logged(request_id)
    result = replay(events, policy)
    assert result.ok, result.divergence and result.divergence.describe()
    return events


def test_a_replica_killed_during_a_pooling_request_is_retried_and_the_client_gets_one_answer(
    database_url: str, upstreams: list[ScriptedUpstream]
) -> None:
    for upstream in upstreams:  # whichever takes the first attempt dies before it answers
        upstream.script({"die_at": 0, "attempt": 1, "delay_first_s": 0.2})
    with gateway_over(database_url, upstreams) as gateway:
        raw = gateway.openai(max_retries=0).embeddings.with_raw_response.create(model=MODEL, input=["x y", "z"])
        created = raw.parse()
        events = judged(gateway, raw.headers["x-request-id"])
    assert [item.embedding for item in created.data] == [
        sim_pooling.vector(MODEL, "x y"),
        sim_pooling.vector(MODEL, "z"),
    ]
    assert [upstream.alive for upstream in upstreams].count(False) == 1  # one was killed
    started = of(events, ev.AttemptStarted)
    assert len(started) == 2 and started[0].replica_id != started[1].replica_id  # type: ignore[attr-defined]
    (failed,) = of(events, ev.UpstreamFailed)
    assert failed.kind is FailureKind.REPLICA_EXITED  # type: ignore[attr-defined]
    state = fold(events)
    assert state.outcome is Outcome.COMPLETED and state.delivered_output_tokens == 0
    (completed,) = of(events, ev.RequestCompleted)
    assert completed.usage["prompt_tokens"] == 3  # type: ignore[attr-defined]
    assert not of(events, ev.FirstDeltaCommitted) and not of(events, ev.DeltasDelivered)


def test_the_cost_guard_holds_a_pooling_retry_whose_prompt_is_too_long(
    database_url: str, upstreams: list[ScriptedUpstream]
) -> None:
    for upstream in upstreams:
        upstream.script({"status": 503, "attempt": 1})  # refused before starting: a retry is wanted
    policy = PolicyConfig(retry_max_prompt_tokens=4)
    with gateway_over(database_url, upstreams, policy=policy) as gateway:
        with pytest.raises(openai.APIStatusError) as caught:
            gateway.openai(max_retries=0).embeddings.create(model=MODEL, input=[list(range(10))])
        events = judged(gateway, caught.value.response.headers["x-request-id"], policy)
        for upstream in upstreams:
            upstream.script()
    assert caught.value.status_code == 503
    assert caught.value.body["code"] == "retry_cost_exceeded"  # type: ignore[index]
    assert len(of(events, ev.AttemptStarted)) == 1
    (accepted,) = of(events, ev.RequestAccepted)
    assert accepted.prompt_tokens == 10  # type: ignore[attr-defined]
    assert fold(events).outcome is Outcome.FAILED
