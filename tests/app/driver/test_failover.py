"""Failover through the gateway over real sim workers, judged by what the client got and by the log.

Each test scripts a fault on the workers (docs/worker-protocol.md), talks only to
the gateway with the openai client or raw HTTP, then compares the client's
transcript with the request's events.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import openai
import pytest

from app.config import Timeouts
from statemachine import events as ev
from statemachine.events import FailureKind, ReleaseReason
from statemachine.replay import replay
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.app.conftest import add_fault
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.transcript import of
from tests.support.workers import WorkerProcess, running_worker

# a worker's lease of 10 s: none of these tests waits one out (a fenced attempt's cancel is
# acknowledged), and a 1 s lease let a gateway stopped by the load for longer than that
# find the attempt ended by the worker itself (its own lease_expired, a death the policy
# does not fence), as the cut cases did (tests/faults/test_token_loop_cut.py)
FAST = Timeouts(stall_s=1.5, lease_ttl_s=10.0, cancel_ack_s=1.0, first_token_soft_s=0.3, first_token_hard_s=5.0)
# for faults the gateway sees at once (a killed process): the default timers, so that a
# loaded machine starving an attempt cannot add a failure the test did not script
PATIENT = Timeouts()


def stream_text(gateway: RunningGateway, prompt: str, max_tokens: int = 8) -> tuple[str, str, int]:
    """Stream a chat through the openai client: (request id, text, content chunks)."""
    stream = gateway.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True, max_tokens=max_tokens, seed=11
    )
    parts = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    return stream.response.headers["x-request-id"], "".join(parts), len(parts)


def clear_faults(workers: list[WorkerProcess]) -> None:
    """Disarm what is left of the scripted faults on the workers still running."""
    for worker in workers:
        if worker.proc.poll() is None:
            httpx.delete(worker.base_url + "/admin/faults", timeout=5).raise_for_status()


def assert_replays(events: list[ev.Event]) -> None:
    result = replay(events)
    assert result.ok, result.divergence and result.divergence.describe()


def assert_one_publisher(events: list[ev.Event]) -> None:
    """No splice: every delivery and the commit point name one attempt."""
    assert len({e.attempt for e in of(events, ev.DeltasDelivered) + of(events, ev.FirstDeltaCommitted)}) <= 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("point", ["prefill", "before_frame"])
def test_a_replica_dying_before_the_first_delta_is_retried_into_one_clean_answer(
    database_url: str, fresh_pair: list[WorkerProcess], unique_prompt: Callable[[str], str], point: str
) -> None:
    prompt = unique_prompt("retry me")
    for worker in fresh_pair:  # whichever replica gets attempt 1 dies
        add_fault(worker, action="die", point=point, at_token=0, match={"prompt_contains": prompt, "attempt": 1})
    with running_gateway(database_url, fresh_pair, timeouts=PATIENT) as gateway:
        request_id, text, _ = stream_text(gateway, prompt)
        clear_faults(fresh_pair)  # the survivor's fault is still armed for an attempt 1
        _again_id, reference, _ = stream_text(gateway, prompt)  # what the surviving replica says to it
        events = gateway.events(request_id)
        assert text == reference != ""
        started = of(events, ev.AttemptStarted)
        assert [s.attempt for s in started] == [1, 2] and started[0].replica_id != started[1].replica_id  # type: ignore[attr-defined]
        (failed,) = of(events, ev.UpstreamFailed)
        assert failed.attempt == 1 and failed.kind is FailureKind.REPLICA_EXITED  # type: ignore[attr-defined]
        assert {e.attempt for e in of(events, ev.DeltasDelivered)} == {2}  # type: ignore[attr-defined]
        assert of(events, ev.FirstDeltaCommitted)[0].attempt == 2  # type: ignore[attr-defined]
        assert fold(events).outcome is Outcome.COMPLETED
        assert "".join(e.text for e in of(events, ev.DeltasDelivered)) == text  # type: ignore[attr-defined]
        assert gateway.metric("phasegate_migration_total", model=MODEL, migration_type="prefill_retry") == 1
        assert_replays(events)


def test_a_replica_dying_after_the_first_delta_ends_the_stream_with_the_structured_error(
    database_url: str, fresh_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt("interrupt me")
    for worker in fresh_pair:
        add_fault(worker, action="die", point="after_frame", at_token=2, match={"prompt_contains": prompt})
    with running_gateway(database_url, fresh_pair, timeouts=PATIENT) as gateway:
        stream = gateway.openai().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True, max_tokens=20
        )
        received: list[str] = []
        with pytest.raises(openai.APIError) as caught:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    received.append(chunk.choices[0].delta.content)
        request_id = stream.response.headers["x-request-id"]
        body = caught.value.body
        assert isinstance(body, dict)
        assert caught.value.code == "upstream_decode_interrupted"
        assert body["partial_output"] is True and body["retryable"] is False
        assert body["delivered_output_tokens"] == len(received) == 3
        assert body["request_id"] == request_id
        events = gateway.events(request_id)
        assert len(of(events, ev.AttemptStarted)) == 1  # no second generation
        assert not [d for d in of(events, ev.Decided) if d.action == "start_attempt" and d.params["attempt"] == 2]  # type: ignore[attr-defined]
        (terminal,) = of(events, ev.RequestFailed)
        assert terminal.delivered_output_tokens == 3 and terminal.partial_output  # type: ignore[attr-defined]
        assert "".join(e.text for e in of(events, ev.DeltasDelivered)) == "".join(received)  # type: ignore[attr-defined]
        assert gateway.metric("phasegate_decode_interrupted_total", model=MODEL) == 1
        assert_one_publisher(events)
        assert_replays(events)


def test_a_client_that_leaves_cancels_upstream_and_nothing_new_starts(
    gateway: RunningGateway, sim_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": unique_prompt("long")}],
        "stream": True,
        "max_tokens": 2000,
        "ignore_eos": True,  # long for sure: a sim answer may end early, before the client leaves
    }
    with gateway.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        request_id = response.headers["x-request-id"]
        lines = response.iter_lines()
        seen = [line for _, line in zip(range(6), lines, strict=False)]
        assert any(line.startswith("data: ") for line in seen)
    events = gateway.events(request_id)
    order = [type(e).__name__ for e in events]
    assert "ClientDisconnected" in order and order.count("AttemptStarted") == 1
    assert fold(events).outcome is Outcome.CANCELLED
    (released,) = of(events, ev.AttemptReleased)
    assert released.because is ReleaseReason.CANCEL_ACKED  # type: ignore[attr-defined]
    (acked,) = of(events, ev.CancelAcked)
    assert 0 < acked.generated_tokens < 2000  # type: ignore[attr-defined]
    assert order.index("ClientDisconnected") < order.index("CancelSent") < order.index("CancelAcked")
    attempts = [httpx.get(w.base_url + "/admin/attempts").json()["attempts"] for w in sim_pair]
    mine = [a for listing in attempts for a in listing if a["request_id"] == request_id]
    assert mine and all(a["engine_over"] and a["stop"] in {"cancelled", "disconnected"} for a in mine), mine
    assert_replays(events)


@pytest.mark.parametrize(("status", "retry_after"), [(429, 30), (503, None)])
def test_a_replica_that_refuses_to_start_is_skipped(
    database_url: str,
    sim_pair: list[WorkerProcess],
    unique_prompt: Callable[[str], str],
    status: int,
    retry_after: int | None,
) -> None:
    prompt = unique_prompt("busy")
    for worker in sim_pair:
        spec = {"action": "reject", "status": status, "match": {"prompt_contains": prompt, "attempt": 1}}
        add_fault(worker, **spec, **({"retry_after": retry_after} if retry_after else {}))
    # a refusal is seen at once: the default timers (FAST's 0.3 s soft deadline, missed by
    # the second attempt on a loaded machine, added a failure the test did not script)
    with running_gateway(database_url, sim_pair, timeouts=PATIENT) as gateway:
        request_id, text, _ = stream_text(gateway, prompt)
        events = gateway.events(request_id)
        rejected, served = (s.replica_id for s in of(events, ev.AttemptStarted))  # type: ignore[attr-defined]
        (failed,) = of(events, ev.UpstreamFailed)
        assert failed.kind is FailureKind.REJECTED and failed.upstream_status == status  # type: ignore[attr-defined]
        assert text and fold(events).outcome is Outcome.COMPLETED
        assert gateway.metric("phasegate_migration_total", model=MODEL, migration_type="new_request") == 1
        next_ids = [stream_text(gateway, unique_prompt("next"))[0] for _ in range(3)]
        replicas = {of(gateway.events(r), ev.AttemptStarted)[0].replica_id for r in next_ids}  # type: ignore[attr-defined]
        if retry_after:  # Retry-After honoured: the refusing replica gets nothing new meanwhile
            assert replicas == {served}
        else:
            assert rejected in replicas


def test_an_upstream_refusal_is_passed_on_and_not_retried(gateway: RunningGateway) -> None:
    long_prompt = " ".join(["word"] * 600)  # over the sim's 512-token context
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_prompt}])
    assert caught.value.code == "context_length_exceeded"  # as through an openai replica
    request_id = caught.value.response.headers["x-request-id"]
    events = gateway.events(request_id)
    assert len(of(events, ev.AttemptStarted)) == 1
    (terminal,) = of(events, ev.RequestFailed)
    assert terminal.code == "context_length_exceeded" and not terminal.retryable  # type: ignore[attr-defined]


@pytest.mark.parametrize("fault", [{"action": "malformed_frame", "at_token": 0}, {"action": "stall", "at_token": 0}])
def test_an_uncertain_attempt_is_fenced_before_the_retry(
    database_url: str, sim_pair: list[WorkerProcess], unique_prompt: Callable[[str], str], fault: dict[str, object]
) -> None:
    prompt = unique_prompt("fence me")
    for worker in sim_pair:
        add_fault(worker, **fault, match={"prompt_contains": prompt, "attempt": 1})
    with running_gateway(database_url, sim_pair, timeouts=FAST) as gateway:
        request_id, text, _ = stream_text(gateway, prompt)
        events = gateway.events(request_id)
    order = [type(e).__name__ for e in events]
    assert text and fold(events).outcome is Outcome.COMPLETED
    (failed,) = of(events, ev.UpstreamFailed)
    assert failed.kind is FailureKind.LIVENESS_UNCERTAIN  # type: ignore[attr-defined]
    second_start = [i for i, e in enumerate(events) if isinstance(e, ev.AttemptStarted)][1]
    fence = order.index("AttemptFenced")
    assert (
        fence < order.index("CancelSent") < order.index("CancelAcked") < order.index("AttemptReleased") < second_start
    )
    assert_one_publisher(events)
    assert_replays(events)


def test_an_overloaded_replica_is_not_migrated_on_the_soft_timeout(
    gateway: RunningGateway, database_url: str, sim_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt("slow")
    for worker in sim_pair:
        add_fault(worker, action="slow_prefill", prefill_ms=1200, match={"prompt_contains": prompt})
    with running_gateway(database_url, sim_pair, timeouts=FAST) as slow_gateway:
        request_id, text, _ = stream_text(slow_gateway, prompt)
        events = slow_gateway.events(request_id)
    assert text and len(of(events, ev.AttemptStarted)) == 1
    (failed,) = of(events, ev.UpstreamFailed)
    assert failed.kind is FailureKind.OVERLOADED and failed.deadline is ev.Deadline.SOFT  # type: ignore[attr-defined]
    assert [d.action for d in of(events, ev.Decided)] == ["start_attempt", "wait"]  # type: ignore[attr-defined]


def test_when_every_replica_fails_before_output_the_client_gets_a_retryable_error(
    database_url: str, sim_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt("doomed")
    for worker in sim_pair:
        add_fault(worker, action="reject", status=503, match={"prompt_contains": prompt})
    with running_gateway(database_url, sim_pair, timeouts=FAST) as gateway:
        with pytest.raises(openai.APIStatusError) as caught:
            stream_text(gateway, prompt)
        assert caught.value.status_code == 502
        body = caught.value.body
        assert isinstance(body, dict)
        assert (body["code"], body["partial_output"], body["retryable"]) == ("upstream_unavailable", False, True)
        events = gateway.events(caught.value.response.headers["x-request-id"])
    assert len(of(events, ev.AttemptStarted)) == 2


def test_a_dead_replica_is_ejected_and_probed_back_in(database_url: str, unique_prompt: Callable[[str], str]) -> None:
    with running_worker(faults=True, args=["--model", MODEL]) as survivor:
        doomed = running_worker(faults=True, args=["--model", MODEL])
        port = doomed.__enter__().port
        replicas = [httpx.URL(f"http://127.0.0.1:{port}"), httpx.URL(survivor.base_url)]
        from app.config import ReplicaConfig

        configs = [ReplicaConfig(id="a", url=str(replicas[0])), ReplicaConfig(id="b", url=str(replicas[1]))]
        with running_gateway(database_url, configs, timeouts=FAST, health_interval_s=0.2) as gateway:
            doomed.__exit__(None, None, None)  # SIGKILL: connection refused from now on
            ids = [stream_text(gateway, unique_prompt("after the kill"))[0] for _ in range(4)]
            assert all(fold(gateway.events(r)).outcome is Outcome.COMPLETED for r in ids)
            pool = gateway.gateway.ctx.pool
            deadline = time.monotonic() + 5
            while pool.replicas["a"].healthy is not False and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pool.replicas["a"].healthy is False
            assert gateway.metric("phasegate_replica_healthy", replica="a") == 0
            with running_worker(faults=True, args=["--model", MODEL, "--port", str(port)]):
                deadline = time.monotonic() + 5
                while pool.replicas["a"].healthy is not True and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert pool.replicas["a"].healthy is True  # probed back in
                later = [stream_text(gateway, unique_prompt("back"))[0] for _ in range(4)]
                served = {of(gateway.events(r), ev.AttemptStarted)[0].replica_id for r in later}  # type: ignore[attr-defined]
                assert served == {"a", "b"}
