"""The gateway in front of real vLLM: a worker with the vLLM engine, and vLLM's own
OpenAI server as a plain replica, both on the tiny local model (see .ci/vllm-env).

The run's shared worker and server serve these tests (tests/support/vllm_replicas.py:
a vLLM start is slow on a small machine); the two that kill the worker run after every
other vllm test, and each gets a live one. ``PHASEGATE_VLLM_DTYPE`` (e.g. ``float32``)
overrides the engines' dtype where bfloat16 cannot run.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import Any

import httpx
import openai
import pytest

from app.api.resume.log import deltas_of
from app.config import ReplicaConfig, Timeouts
from statemachine import events as ev
from statemachine.events import FailureKind, ReleaseReason
from statemachine.invariants import violations
from statemachine.replay import replay
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.app.conftest import add_fault
from tests.support.audit import fold_disagreements_in
from tests.support.gateway import RunningGateway, running_gateway
from tests.support.transcript import Transcript, check_request, of, stream_chat
from tests.support.vllm_replicas import MODEL, SharedVllm

pytestmark = pytest.mark.vllm

MESSAGES = [{"role": "user", "content": "hello there, tell me a story"}]
TIMEOUTS = Timeouts(
    stall_s=10.0, lease_ttl_s=3.0, first_token_soft_s=10.0, first_token_hard_s=60.0, upstream_response_s=30.0
)


def gateway_over(
    database_url: str, vllm: SharedVllm, *, worker_only: bool = False
) -> AbstractContextManager[RunningGateway]:
    replicas = [ReplicaConfig(id="a-worker", url=vllm.worker().base_url, kind="worker")]
    if not worker_only:
        replicas.append(ReplicaConfig(id="b-server", url=vllm.server_url, kind="openai"))
    # a client that leaves is cancelled at once (the vLLM abort is what is tested)
    return running_gateway(database_url, replicas, models={MODEL: "tiny-rev"}, timeouts=TIMEOUTS, resume_grace_s=0)


def ask(client: openai.OpenAI, *, stream: bool) -> tuple[str, str]:
    if stream:
        chunks = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, max_tokens=16, temperature=0
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return chunks.response.headers["x-request-id"], text
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    return raw.headers["x-request-id"], raw.parse().choices[0].message.content or ""


def served_by(gateway: RunningGateway, request_id: str) -> list[str]:
    return [e.replica_id for e in gateway.events(request_id) if isinstance(e, ev.AttemptStarted)]


def long_body(max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0}


def timeline(events: list[ev.Event]) -> str:
    """The request's events with their times, for an assertion's message."""
    t0 = events[0].occurred_at
    return "\n".join(
        f"{e.seq:3} +{(e.occurred_at - t0).total_seconds() * 1000:8.1f} ms {type(e).__name__}" for e in events
    )


def assert_sound(gateway: RunningGateway, database_url: str, events: list[ev.Event]) -> None:
    """The log's invariants, a replay without divergence, read models that agree with the fold."""
    assert violations(events) == []
    result = replay(events)
    assert result.ok, result.divergence and result.divergence.describe()
    assert fold_disagreements_in(database_url, [events[0].request_id]) == []


def test_both_vllm_replica_kinds_serve_streamed_and_whole_answers(database_url: str, vllm: SharedVllm) -> None:
    with gateway_over(database_url, vllm) as gateway:
        client = gateway.openai(timeout=120.0)
        answers: dict[str, set[str]] = {}
        for stream in (True, False, True, False):
            request_id, text = ask(client, stream=stream)
            (replica,) = served_by(gateway, request_id)
            answers.setdefault(replica, set()).add(text)
            events = gateway.events(request_id)
            assert fold(events).outcome is Outcome.COMPLETED and replay(events).ok
            assert delivered(events, "content") == text
            # both run vLLM's reasoning parser (the worker's: app/worker/vllm_parsing.py): the
            # think block is apart
            assert delivered(events, "reasoning") == " first client may retry,"
        assert set(answers) == {"a-worker", "b-server"}  # both kinds took requests
        assert all(len(texts) == 1 and "" not in texts for texts in answers.values())  # temperature 0
        (worker_text,), (server_text,) = answers["a-worker"], answers["b-server"]
        assert worker_text == server_text


def delivered(events: list[ev.Event], key: str) -> str:
    """The text the log says was delivered under ``key`` (content, reasoning)."""
    batches = [e for e in events if isinstance(e, ev.DeltasDelivered)]
    return "".join(d.text for batch in batches for d in deltas_of(batch) if d.key == key)


def test_vllms_extras_and_logprobs_through_both_replica_kinds(database_url: str, vllm: SharedVllm) -> None:
    """top_k and friends, a structured-output choice and log probabilities reach the vLLM
    engine in the worker and vLLM's own server, and both answer alike (temperature 0).

    Both run vLLM's reasoning parser (the worker's: app/worker/vllm_parsing.py): the choice
    constrains the output once the think block ends, and the log probabilities cover the
    reasoning tokens too (as vLLM gives them)."""
    extras = {"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.05, "structured_outputs": {"choice": ["yes", "no"]}}
    with gateway_over(database_url, vllm) as gateway:
        client = gateway.openai(timeout=120.0)
        got: dict[str, tuple[str, list[Any]]] = {}
        # the pool alternates: one answer from each kind; a loaded machine can make a probe
        # of the worker fall silent and eject it for a while, so ask until both answered
        deadline = time.monotonic() + 120.0
        while set(got) != {"a-worker", "b-server"} and time.monotonic() < deadline:
            answer = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=8,
                temperature=0,
                logprobs=True,
                top_logprobs=2,
                extra_body=extras,
            )
            parsed = answer.parse()
            replica = served_by(gateway, answer.headers["x-request-id"])[-1]  # a retry's: the last attempt answered
            content = parsed.choices[0].logprobs.content  # type: ignore[union-attr]
            if replica in got:  # the other is out of the pool for now
                time.sleep(0.5)
            got[replica] = (parsed.choices[0].message.content or "", content)
            assert_sound(gateway, database_url, gateway.events(answer.headers["x-request-id"]))
    assert set(got) == {"a-worker", "b-server"}
    for replica, (text, content) in got.items():
        assert text in ("yes", "no")  # the choice constrained the output
        thought = " first client may retry,</think>"
        assert "".join(entry.token for entry in content) == thought + text, replica  # none for the end of sequence
        assert all(entry.logprob <= 0 and 1 <= len(entry.top_logprobs) <= 2 for entry in content)
    (worker_text, worker_lp), (server_text, server_lp) = got["a-worker"], got["b-server"]
    assert worker_text == server_text and [e.token for e in worker_lp] == [e.token for e in server_lp]
    assert all(abs(a.logprob - b.logprob) < 0.05 for a, b in zip(worker_lp, server_lp, strict=True))


def test_a_client_leaving_mid_answer_is_cancelled_and_acknowledged_by_the_vllm_engine(
    database_url: str, vllm: SharedVllm
) -> None:
    """The client closes its stream after its first delta: the gateway cancels the attempt,
    the worker aborts the vLLM request and acknowledges only once the engine confirmed it.

    The tiny model decodes a few hundred tokens a second on CPU, so the request asks for
    all the context allows; the cancel path (disconnect noticed, cancel sent, abort) takes
    milliseconds, which leaves the engine mid-answer by a wide margin."""
    max_tokens = 480  # of a 512-token context; far more than is decoded before the cancel lands
    with gateway_over(database_url, vllm, worker_only=True) as gateway:
        transcript = stream_chat(gateway.url, long_body(max_tokens), on_delta=lambda n: n >= 1, timeout=120.0)
        events = gateway.events(transcript.request_id)
        assert_sound(gateway, database_url, events)
    # the client: the first delta of an answer, then it left (no error, no end)
    assert transcript.status == 200 and len(transcript.contents) == 1
    assert transcript.error is None and not transcript.done
    # the log: the disconnect, then the cancel, its acknowledgement and the release, in order
    state = fold(events)
    assert state.outcome is Outcome.CANCELLED
    assert [e.replica_id for e in of(events, ev.AttemptStarted)] == ["a-worker"]  # type: ignore[attr-defined]
    order = [type(e).__name__ for e in events]
    for name in ("ClientDisconnected", "CancelSent", "CancelAcked", "AttemptReleased", "RequestCancelled"):
        assert order.count(name) == 1, (name, order)
    assert (
        order.index("FirstDeltaCommitted")
        < order.index("ClientDisconnected")
        < order.index("CancelSent")
        < order.index("CancelAcked")
    )
    assert order.index("CancelAcked") < order.index("AttemptReleased")
    (released,) = of(events, ev.AttemptReleased)
    assert released.because is ReleaseReason.CANCEL_ACKED  # type: ignore[attr-defined]
    (acked,) = of(events, ev.CancelAcked)
    # stopped early, or, on a loaded machine, the engine was done before the cancel reached it:
    # the acknowledgement still names the attempt and what it generated
    assert 1 <= acked.generated_tokens <= max_tokens, timeline(events)  # type: ignore[attr-defined]
    assert not of(events, ev.RequestCompleted) and not of(events, ev.RequestFailed)
    # what the log says was delivered begins with exactly what the client read (the gateway may
    # have written a few more deltas into the socket before it saw the client go)
    delivered = "".join(e.text or "" for e in of(events, ev.DeltasDelivered))  # type: ignore[attr-defined]
    assert delivered.startswith(transcript.text) and state.delivered_output_tokens >= 1
    # the worker's own view: the engine request was aborted, not finished (the worker may have
    # seen the gateway close the stream before the cancel arrived: it stops on whichever came first)
    attempts = httpx.get(vllm.worker().base_url + "/admin/attempts", timeout=10).json()["attempts"]
    (mine,) = [a for a in attempts if a["request_id"] == transcript.request_id]
    assert mine["engine_over"], mine
    # (or, on a loaded machine, its lease there lapsed first: aborted all the same)
    if acked.generated_tokens < max_tokens:  # type: ignore[attr-defined]
        assert mine["stop"] in {"cancelled", "disconnected", "lease_expired"}, mine


def test_a_vllm_workers_attempt_broken_before_the_first_delta_is_fenced_and_retried_on_the_vllm_server(
    database_url: str, vllm: SharedVllm
) -> None:
    """The worker's stream breaks (a malformed frame) before the first delta: the gateway
    fences the attempt (the engine's abort, acknowledged) and retries it on the server.
    The worker lives on: a vLLM start is a minute of both cores here, and a worker killed
    before the first delta is shown with sim workers (tests/app/driver/test_real_paths.py)."""
    worker = vllm.worker()
    with gateway_over(database_url, vllm) as gateway:
        client = gateway.openai(timeout=120.0)
        reference_id, reference = ask(client, stream=True)
        if served_by(gateway, reference_id) != ["b-server"]:
            reference_id, reference = ask(client, stream=True)  # the next one goes to the server
        assert served_by(gateway, reference_id) == ["b-server"]
        add_fault(worker, action="malformed_frame", at_token=0, match={"attempt": 1})
        request_id, text = ask(client, stream=True)
        assert served_by(gateway, request_id) == ["a-worker", "b-server"]
        assert text == reference  # one clean answer: the server's own
        events = gateway.events(request_id)
        assert {e.attempt for e in events if isinstance(e, ev.DeltasDelivered)} == {2}
        (failed,) = of(events, ev.UpstreamFailed)
        assert (failed.attempt, failed.kind) == (1, FailureKind.LIVENESS_UNCERTAIN)  # type: ignore[attr-defined]
        (acked,) = of(events, ev.CancelAcked)  # fenced by the engine's confirmed abort
        assert acked.attempt == 1  # type: ignore[attr-defined]
        assert replay(events).ok
    assert worker.alive()


@pytest.mark.ends_vllm_worker
def test_a_vllm_worker_killed_mid_answer_ends_the_stream_with_the_final_error(
    database_url: str, vllm: SharedVllm
) -> None:
    """The worker process is SIGKILLed right after its fourth token frame went out: the
    deltas the client already has stay, the stream ends with upstream_decode_interrupted,
    and no second generation starts although the vLLM server is there to take one."""
    worker = vllm.worker()
    with gateway_over(database_url, vllm) as gateway:
        client = gateway.openai(timeout=120.0)
        # a reference from the worker itself (temperature 0), then one request to the server,
        # so that the least-recently-chosen rule sends the faulted request to the worker
        reference_id, reference = ask_long(gateway)
        if served_by(gateway, reference_id) != ["a-worker"]:
            reference_id, reference = ask_long(gateway)
        assert served_by(gateway, reference_id) == ["a-worker"] and reference
        between_id, _ = ask(client, stream=True)
        assert served_by(gateway, between_id) == ["b-server"]
        add_fault(worker, action="die", point="after_frame", at_token=3, match={"attempt": 1})
        transcript = stream_chat(gateway.url, long_body(32), timeout=120.0)
        events = gateway.events(transcript.request_id)
        assert_sound(gateway, database_url, events)
        check_request(events, transcript)  # the client's text is what the log says it delivered
    assert not worker.alive() and worker.wait(timeout=30) < 0  # killed by the fault, not a clean exit
    # the client: part of the worker's answer, then the final error naming what it got
    assert transcript.status == 200 and transcript.done and transcript.error is not None
    error = transcript.error
    assert (error["code"], error["partial_output"], error["retryable"]) == ("upstream_decode_interrupted", True, False)
    assert error["request_id"] == transcript.request_id
    # four frames at most; vLLM merges the outputs a busy consumer has not read yet, so a
    # frame may carry more than one token, and under load four frames have held the whole
    # text (the full suite, this stop): then only the finish is what the kill cut
    assert 1 <= len(transcript.contents) <= 4 and error["delivered_output_tokens"] >= len(transcript.contents)
    assert reference.startswith(transcript.text) and transcript.finish_reason is None
    # the log: one attempt on the worker, no retry decided, the terminal event as the client was told
    assert [e.replica_id for e in of(events, ev.AttemptStarted)] == ["a-worker"]  # type: ignore[attr-defined]
    assert not [d for d in of(events, ev.Decided) if d.action == "start_attempt" and d.params["attempt"] > 1]  # type: ignore[attr-defined]
    (terminal,) = of(events, ev.RequestFailed)
    assert (terminal.code, terminal.partial_output, terminal.retryable) == ("upstream_decode_interrupted", True, False)  # type: ignore[attr-defined]
    assert terminal.delivered_output_tokens == error["delivered_output_tokens"] == fold(events).delivered_output_tokens  # type: ignore[attr-defined]
    assert {e.attempt for e in of(events, ev.DeltasDelivered)} == {1}  # type: ignore[attr-defined]


def ask_long(gateway: RunningGateway) -> tuple[str, str]:
    """The same request as the faulted one, answered in full: (request id, text)."""
    transcript: Transcript = stream_chat(gateway.url, long_body(32), timeout=120.0)
    assert transcript.done and transcript.error is None
    return transcript.request_id, transcript.text
