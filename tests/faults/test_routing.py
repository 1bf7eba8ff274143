"""Where attempts go, with real parts (docs/routing.md): a real gateway in front of scripted
OpenAI-compatible upstreams in their own processes, the real ``openai`` client, and
the log read back from PostgreSQL. Each test judges by what the client received and
what the log says, and replays the log."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from app.config import ReplicaConfig
from statemachine import events as ev
from statemachine.replay import replay
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.support.gateway import REVISION, RunningGateway, running_gateway
from tests.support.scripted_upstream import ScriptedUpstream, answer, running_scripted_upstream
from tests.support.transcript import of

PROMPT = "where does this attempt go"
SMALL, BIG = "small", "big"
ADMIN_TOKEN = "routing-admin-token"
REFUSAL = {"status": 400, "code": "context_length_exceeded", "message": "the prompt is too long", "param": "messages"}


@pytest.fixture(scope="module")
def upstreams() -> Iterator[tuple[ScriptedUpstream, ScriptedUpstream]]:
    with running_scripted_upstream() as small, running_scripted_upstream() as big:
        yield small, big


@pytest.fixture
def gateway(database_url: str, upstreams: tuple[ScriptedUpstream, ScriptedUpstream]) -> Iterator[RunningGateway]:
    """One replica per model; ``small`` falls back to ``big`` on a context-length refusal."""
    small, big = upstreams
    for upstream in upstreams:
        upstream.script()  # nothing queued from an earlier test
    replicas = [
        ReplicaConfig(id="small-1", url=small.base_url, kind="openai", models=(SMALL,)),
        ReplicaConfig(id="big-1", url=big.base_url, kind="openai", models=(BIG,)),
    ]
    routing = {"models": {SMALL: {"context_window_fallbacks": [BIG]}}}
    models = {SMALL: REVISION, BIG: REVISION}
    with running_gateway(database_url, replicas, models=models, routing=routing, admin_token=ADMIN_TOKEN) as running:
        yield running


def chat(gateway: RunningGateway, model: str = SMALL) -> tuple[str, str, str]:
    """(request id, the text the client got, the model its chunks named)."""
    stream = gateway.openai().chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], stream=True, max_tokens=5
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return stream.response.headers["x-request-id"], text, chunks[0].model


def assert_replays(events: list[ev.Event]) -> None:
    result = replay(events)
    assert result.ok, result.divergence and result.divergence.describe()


def test_a_429_with_a_short_retry_after_is_retried_on_the_same_replica_after_the_wait(
    gateway: RunningGateway, upstreams: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    small, _ = upstreams
    small.script({"status": 429, "retry_after": 1, "attempt": 1})
    before = small.requests
    started = time.monotonic()
    request_id, text, model = chat(gateway)
    assert time.monotonic() - started >= 1.0  # the advised wait, kept
    assert (text, model) == ("".join(answer(PROMPT, 5)), SMALL)
    assert small.requests - before == 2  # asked again after the wait, nothing in between
    events = gateway.events(request_id)
    (failed,) = of(events, ev.UpstreamFailed)
    assert (failed.upstream_status, failed.retry_after_s) == (429, 1.0)  # type: ignore[attr-defined]
    (waited,) = of(events, ev.RetryWaitElapsed)
    assert waited.replica_id == "small-1"  # type: ignore[attr-defined]
    assert [s.replica_id for s in of(events, ev.AttemptStarted)] == ["small-1", "small-1"]  # type: ignore[attr-defined]
    decided = [e for e in of(events, ev.Decided) if e.action == "start_attempt"]  # type: ignore[attr-defined]
    assert decided[-1].params["placement"].startswith("same replica")  # type: ignore[attr-defined]
    state = fold(events)
    assert state.outcome is Outcome.COMPLETED and state.delivered_deltas == 5  # the log says what the client got
    assert_replays(events)
    with gateway.http(headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as http:  # the timeline shows it
        page = http.get(f"/ui/requests/{request_id}").text
    assert "wait_to_retry" in page and "same replica: no other is healthier (waited 1s)" in page


def test_one_server_error_is_retried_on_the_same_replica_at_once(
    gateway: RunningGateway, upstreams: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    small, _ = upstreams
    small.script({"status": 500, "attempt": 1})
    request_id, text, _ = chat(gateway)
    assert text == "".join(answer(PROMPT, 5))
    events = gateway.events(request_id)
    assert [s.replica_id for s in of(events, ev.AttemptStarted)] == ["small-1", "small-1"]  # type: ignore[attr-defined]
    assert not of(events, ev.RetryWaitElapsed)  # no Retry-After: no wait
    assert fold(events).outcome is Outcome.COMPLETED
    assert_replays(events)


def test_context_length_exceeded_is_answered_by_the_fallback_model(
    gateway: RunningGateway, upstreams: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    small, big = upstreams
    small.script({**REFUSAL, "attempt": 1})
    before = big.requests
    request_id, text, model = chat(gateway)
    assert text == "".join(answer(PROMPT, 5))
    assert model == BIG  # the response says which model answered
    assert big.requests - before == 1 and big.last_body is not None and big.last_body["model"] == BIG
    events = gateway.events(request_id)
    first, second = of(events, ev.AttemptStarted)
    assert (first.replica_id, first.model, second.replica_id, second.model) == ("small-1", None, "big-1", BIG)  # type: ignore[attr-defined]
    state = fold(events)
    assert state.outcome is Outcome.COMPLETED and state.answered_by == BIG
    assert gateway.metric("phasegate_migration_total", model=SMALL, migration_type="model_fallback") >= 1
    assert_replays(events)


def test_with_no_fallback_left_the_client_gets_the_original_refusal_unchanged(
    gateway: RunningGateway, upstreams: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    small, big = upstreams
    small.script({**REFUSAL, "attempt": 1})
    big.script({**REFUSAL, "attempt": 2})
    with pytest.raises(openai.BadRequestError) as caught:
        chat(gateway)
    error = caught.value
    assert (error.code, error.param) == ("context_length_exceeded", "messages")
    assert "the prompt is too long" in error.message
    events = gateway.events(error.response.headers["x-request-id"])
    assert [s.model for s in of(events, ev.AttemptStarted)] == [None, BIG]  # type: ignore[attr-defined]
    (end,) = of(events, ev.RequestFailed)
    assert (end.code, end.partial_output, end.delivered_output_tokens) == ("context_length_exceeded", False, 0)  # type: ignore[attr-defined]
    assert_replays(events)


def test_a_model_without_fallbacks_passes_the_refusal_on_at_once(
    gateway: RunningGateway, upstreams: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    _, big = upstreams
    big.script({**REFUSAL, "attempt": 1})
    with pytest.raises(openai.BadRequestError) as caught:
        chat(gateway, model=BIG)
    assert caught.value.code == "context_length_exceeded"
    events = gateway.events(caught.value.response.headers["x-request-id"])
    assert len(of(events, ev.AttemptStarted)) == 1
