"""DESIGN.md §10: every failure kind at every point of the token loop, for both replica kinds.

Each case scripts one fault on the replicas (whichever takes the first attempt
misbehaves), streams one request through a real gateway with a raw SSE client, and
judges by what the client received and by the log (``check_request``): no
duplicate, gap or splice; one terminal event; attempts that never overlapped; a
replay without divergence; and the scenario's own expectations below.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import httpx
import pytest

from app.config import Timeouts
from statemachine import events as ev
from statemachine.events import FailureKind, ReleaseReason
from statemachine.request_state import Outcome, RequestState
from tests.faults.conftest import Evidence, Fleet, fleet_of
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.scripted_upstream import running_scripted_upstream
from tests.support.transcript import Transcript, check_request, of, released_by, stream_chat

N = 8  # token indices 0…N
INDICES = list(range(N + 1))
TIMEOUTS = Timeouts(
    stall_s=1.0,
    lease_ttl_s=1.0,
    cancel_ack_s=0.5,
    first_token_soft_s=0.3,
    first_token_hard_s=5.0,
    upstream_response_s=5.0,
)


def body(prompt: str, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "seed": 3, **extra}


def prompt_for(name: str) -> str:
    return f"{name} {uuid.uuid4().hex[:10]}"


def settle(gateway: RunningGateway, transcript: Transcript, evidence: Evidence) -> tuple[list[ev.Event], RequestState]:
    events = gateway.events(transcript.request_id)
    inputs = gateway.call(gateway.gateway.ctx.store.read_input(transcript.request_id))
    evidence.keep(transcript.request_id, events, transcript, inputs and inputs.body)
    return events, check_request(events, transcript)


def replicas_of(events: list[ev.Event]) -> list[str]:
    return [e.replica_id for e in of(events, ev.AttemptStarted)]  # type: ignore[attr-defined]


@pytest.fixture
def gateway(database_url: str, live_fleet: Fleet) -> Iterator[RunningGateway]:
    with running_gateway(database_url, live_fleet.configs, timeouts=TIMEOUTS, health_interval_s=30) as running:
        yield running


def reference(gateway: RunningGateway, prompt: str) -> str:
    """What a healthy replica answers to ``prompt`` (every replica answers the same)."""
    return stream_chat(gateway.url, body(prompt)).text


# --- 1. death during prefill -----------------------------------------------------------------


def test_1_death_in_prefill_gives_one_complete_answer(
    gateway: RunningGateway, live_fleet: Fleet, evidence: Evidence
) -> None:
    prompt = prompt_for("prefill death")
    live_fleet.fault_first_attempt(prompt, "die", point="prefill")
    transcript = stream_chat(gateway.url, body(prompt))
    events, state = settle(gateway, transcript, evidence)
    assert state.outcome is Outcome.COMPLETED and transcript.done
    assert replicas_of(events) == ["r1", "r2"]
    assert transcript.text == reference(gateway, prompt) != ""  # the second replica's own answer
    assert of(events, ev.UpstreamFailed)[0].kind is FailureKind.REPLICA_EXITED  # type: ignore[attr-defined]


# --- 2. death after token k was computed, before its event was written ----------------------------


@pytest.mark.parametrize("k", INDICES)
def test_2_death_before_token_k_is_written(
    gateway: RunningGateway, live_fleet: Fleet, evidence: Evidence, k: int
) -> None:
    prompt = prompt_for(f"fragment {k}")
    live_fleet.fault_first_attempt(prompt, "die", k=k, point="before_frame")
    transcript = stream_chat(gateway.url, body(prompt))
    events, state = settle(gateway, transcript, evidence)
    answer = reference(gateway, prompt)
    if k == 0:  # nothing reached the client: retried into one clean answer
        assert state.outcome is Outcome.COMPLETED and replicas_of(events) == ["r1", "r2"]
        assert transcript.text == answer
    else:  # k deltas were delivered: the stream ends, the fragment never shows
        assert state.outcome is Outcome.FAILED and replicas_of(events) == ["r1"]
        assert transcript.error is not None and transcript.error["code"] == "upstream_decode_interrupted"
        assert transcript.contents == list(_tokens(answer, k)), "the client saw the fragment or lost a token"


# --- 3. death right after delta k reached the client --------------------------------------------


@pytest.mark.parametrize("k", INDICES)
def test_3_death_after_delta_k_ends_the_stream(
    gateway: RunningGateway, live_fleet: Fleet, evidence: Evidence, k: int
) -> None:
    prompt = prompt_for(f"after {k}")
    live_fleet.fault_first_attempt(prompt, "die", k=k, point="after_frame")
    transcript = stream_chat(gateway.url, body(prompt))
    events, state = settle(gateway, transcript, evidence)
    assert state.outcome is Outcome.FAILED and replicas_of(events) == ["r1"]  # no second generation
    assert not [d for d in of(events, ev.Decided) if d.action == "start_attempt" and d.params["attempt"] > 1]  # type: ignore[attr-defined]
    assert transcript.error is not None and transcript.done
    error = transcript.error
    assert (error["code"], error["partial_output"], error["retryable"]) == ("upstream_decode_interrupted", True, False)
    assert error["delivered_output_tokens"] == len(transcript.contents) == k + 1
    assert transcript.contents == list(_tokens(reference(gateway, prompt), k + 1))


# --- 5. death after a tool call was emitted ----------------------------------------------------


TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("k", INDICES)
def test_5_a_tool_call_runs_once_however_many_attempts_ask(
    database_url: str, live_fleet: Fleet, evidence: Evidence, k: int
) -> None:
    if live_fleet.kind == "openai" and k > 0:
        pytest.skip("the scripted OpenAI upstream emits its tool call first: only k = 0 exists there")
    prompt = prompt_for(f"tool {k}")
    live_fleet.fault_first_attempt(prompt, "tool_call_then_die", k=k)
    # k = 0: the request offers tools and the replica's own first output is the call;
    # k > 0: k content deltas reach the client, then the replica asks for a tool and dies
    request = body(prompt, tools=TOOLS) if k == 0 else body(prompt)
    with (
        _tool_webhook() as (url, runs),
        running_gateway(
            database_url, live_fleet.configs, timeouts=TIMEOUTS, tool_webhook_url=url, health_interval_s=30
        ) as gateway,
    ):
        transcript = stream_chat(gateway.url, request)
        events, state = settle(gateway, transcript, evidence)
        emitted = of(events, ev.ToolCallEmitted)
        keys = {e.idempotency_key for e in emitted}  # type: ignore[attr-defined]
        assert len(keys) == 1, "every attempt that asked named the same call"
        (key,) = keys
        ledger = gateway.call(gateway.gateway.ctx.store.tool_execution(key))
        assert ledger is not None and ledger.attempt == emitted[0].attempt  # type: ignore[attr-defined]
        assert runs() == {key: 1}  # executed once, through the ledger
    if k > 0:  # the stream was already delivering: it ends, the call is never delivered
        assert state.outcome is Outcome.FAILED and len(emitted) == 1 and not transcript.tool_calls
        return
    assert replicas_of(events) == ["r1", "r2"] and state.outcome is Outcome.COMPLETED
    assert [c["id"] for c in transcript.tool_calls] == [emitted[-1].tool_call_id]  # type: ignore[attr-defined]
    # a worker publishes the call whole, so both attempts asked for it; an OpenAI upstream
    # streams it in pieces, and the one cut off mid-call never asked
    assert [e.attempt for e in emitted] == ([1, 2] if live_fleet.kind == "worker" else [2])  # type: ignore[attr-defined]


# --- 6. an overloaded replica --------------------------------------------------------------------


def test_6_an_overloaded_replica_is_not_migrated_on_the_soft_timeout(
    gateway: RunningGateway, live_fleet: Fleet, evidence: Evidence
) -> None:
    prompt = prompt_for("overloaded")
    live_fleet.fault_first_attempt(prompt, "slow_first", seconds=1.5)
    transcript = stream_chat(gateway.url, body(prompt))
    events, state = settle(gateway, transcript, evidence)
    assert state.outcome is Outcome.COMPLETED and replicas_of(events) == ["r1"]
    failures = of(events, ev.UpstreamFailed)
    if live_fleet.kind == "worker":  # heartbeats flowed: the soft timer fired and the policy waited
        assert [(f.kind, f.deadline) for f in failures] == [(FailureKind.OVERLOADED, ev.Deadline.SOFT)]  # type: ignore[attr-defined]
        assert [d.action for d in of(events, ev.Decided)] == ["start_attempt", "wait"]  # type: ignore[attr-defined]
    else:  # silent prefill on this kind: only the hard deadline could act, and it did not pass
        assert failures == []


# --- 4 and 7 need the network cut or the client gone at an exact token: slow tokens ------------


@pytest.fixture(scope="module", params=["worker", "openai"])
def slow_fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    with fleet_of(request.param, decode_ms=150.0) as started:
        yield started


@pytest.fixture
def slow_gateway(database_url: str, slow_fleet: Fleet) -> Iterator[RunningGateway]:
    slow_fleet.revive()
    # test 7: a client that leaves is cancelled at once (tests/app/api/test_disconnect_grace.py: the grace)
    with running_gateway(
        database_url, slow_fleet.configs, timeouts=TIMEOUTS, health_interval_s=30, resume_grace_s=0
    ) as running:
        yield running


@pytest.mark.parametrize("k", INDICES)
def test_4_a_network_cut_fences_the_old_attempt_before_anything_else(
    slow_gateway: RunningGateway, slow_fleet: Fleet, evidence: Evidence, k: int
) -> None:
    prompt = prompt_for(f"cut {k}")
    first = slow_fleet.replicas[0]
    cut_done = threading.Event()

    def cut_when_started() -> None:  # k = 0: cut once the attempt started, before any token
        deadline = time.monotonic() + 10
        while not slow_gateway.gateway.ctx.drivers and time.monotonic() < deadline:
            time.sleep(0.005)
        first.proxy.blackhole()
        cut_done.set()

    if k == 0:
        threading.Thread(target=cut_when_started, daemon=True).start()
        transcript = stream_chat(slow_gateway.url, body(prompt, max_tokens=N + 4))
    else:
        cut = first.proxy.blackhole
        transcript = stream_chat(slow_gateway.url, body(prompt, max_tokens=N + 4), on_delta=lambda n: n == k and cut())
    time.sleep(TIMEOUTS.lease_ttl_s + 0.5)
    first.proxy.restore()  # the network comes back: the old attempt must stay silent
    events, state = settle(slow_gateway, transcript, evidence)
    order = [type(e).__name__ for e in events]
    fenced_at = order.index("AttemptFenced")
    after_fence = events[fenced_at + 1 :]
    assert not [e for e in after_fence if isinstance(e, ev.DeltasDelivered | ev.FirstTokenReceived) and e.attempt == 1]
    if slow_fleet.kind == "openai" and k == 0:  # nothing delivered: the closed connection is the fence
        assert released_by(events, 1) is ReleaseReason.CONNECTION_CLOSED
    else:
        assert released_by(events, 1) in (ReleaseReason.CANCEL_ACKED, ReleaseReason.LEASE_EXPIRED)
    if k == 0:
        release = next(i for i, e in enumerate(events) if isinstance(e, ev.AttemptReleased) and e.attempt == 1)
        second = next(i for i, e in enumerate(events) if isinstance(e, ev.AttemptStarted) and e.attempt == 2)
        assert order.index("CancelSent") < release < second  # fenced and released before the retry
        assert state.outcome is Outcome.COMPLETED and replicas_of(events) == ["r1", "r2"]
    else:
        assert state.outcome is Outcome.FAILED and replicas_of(events) == ["r1"]
        assert transcript.error is not None and transcript.error["delivered_output_tokens"] == len(transcript.contents)
    # k = 0 may cut before the start request even reached the worker (the proxy holds it):
    # then the worker's view has nothing to say; the log above already proved the rule
    if slow_fleet.kind == "worker" and k > 0:  # the worker's view: stopped by its lease, or done before
        attempts = httpx.get(first.direct_url + "/admin/attempts").json()["attempts"]
        (mine,) = [a for a in attempts if a["request_id"] == transcript.request_id]
        assert mine["engine_over"] and mine["stop"] in ("lease_expired", "cancelled", None)


@pytest.mark.parametrize("k", INDICES)
def test_7_a_client_leaving_at_token_k_cancels_upstream(
    slow_gateway: RunningGateway, slow_fleet: Fleet, evidence: Evidence, k: int
) -> None:
    prompt = prompt_for(f"leave {k}")
    if k == 0:  # gone before the first delta: the client gives up while headers are held back
        with pytest.raises(httpx.ReadTimeout):
            stream_chat(slow_gateway.url, body(prompt, max_tokens=N + 4), timeout=0.05)
        transcript = Transcript(_only_request_id(slow_gateway), 200)
    else:
        transcript = stream_chat(slow_gateway.url, body(prompt, max_tokens=N + 4), on_delta=lambda n: n >= k)
    events, state = settle(slow_gateway, transcript, evidence)
    assert state.outcome is Outcome.CANCELLED and replicas_of(events) == ["r1"]  # nothing new started
    order = [type(e).__name__ for e in events]
    assert "ClientDisconnected" in order and "CancelSent" in order
    expected = ReleaseReason.CANCEL_ACKED if slow_fleet.kind == "worker" else ReleaseReason.LEASE_EXPIRED
    assert released_by(events, 1) is expected  # acknowledged where the replica can
    assert state.delivered_output_tokens == len(transcript.contents) <= k + 1


# --- helpers -----------------------------------------------------------------------------------


def _tokens(answer: str, count: int) -> Iterator[str]:
    """The first ``count`` deltas of ``answer`` as the replicas cut it (a leading space per word)."""
    words = answer.split(" ")
    pieces = (
        [" " + w for w in words[1:]] if answer.startswith(" ") else [words[0] + " ", *[w + " " for w in words[1:-1]]]
    )
    return iter(pieces[:count])


def _only_request_id(gateway: RunningGateway) -> str:
    """The one request of this test's fresh database (for a client that never got headers)."""

    async def first_accepted() -> str:
        async for _, event in gateway.gateway.ctx.store.follow(0):
            if isinstance(event, ev.RequestAccepted):
                return event.request_id
        raise AssertionError("no request was accepted")

    return gateway.call(first_accepted(), timeout=10)


@contextlib.contextmanager
def _tool_webhook() -> Iterator[tuple[str, Callable[[], dict[str, int]]]]:
    """A real webhook process that counts tool executions per idempotency key."""
    with running_scripted_upstream() as hook:
        yield hook.base_url + "/tools/execute", lambda: hook.tool_runs
