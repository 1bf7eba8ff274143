"""Failure paths through the real driver that only pure tests covered: whole (non-streamed)
answers, the retry budgets and the cost guard, and requests for several choices.

Black box: real sim workers with scripted faults (docs/worker-protocol.md), a real
gateway, real PostgreSQL; the client is the ``openai`` SDK or raw HTTP/SSE. Every test
judges one request by what its client received *and* by its log: the events read back
through the store, the ``requests`` read model read with SQL, the log's invariants and
a replay without divergence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from app.config import Timeouts
from statemachine import events as ev
from statemachine.events import FailureKind
from statemachine.invariants import violations
from statemachine.policy_config import PolicyConfig
from statemachine.replay import replay
from statemachine.request_state import Outcome, RequestState
from statemachine.state import fold
from tests.app.conftest import add_fault
from tests.support.audit import fold_disagreements_in, read_model_row
from tests.support.choices import ChoiceTranscript, stream_choices
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.transcript import check_request, of
from tests.support.workers import WorkerProcess

# The faults here kill a process or refuse an attempt, which the gateway sees at once; none
# waits out a timer. The default timers stay: a short stall or lease timer would fail an
# attempt that a loaded machine merely starved, and add a failure the test did not script.
TIMEOUTS = Timeouts()
MAX_TOKENS = 8


def body(prompt: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "seed": 5,
        **extra,
    }


def post(gateway: RunningGateway, request: dict[str, Any]) -> tuple[int, str, dict[str, Any]]:
    """A request whose answer is read whole (streamed or not): (status, request id, JSON body).

    A streamed request that failed before its headers went out answers with a plain
    JSON error, which is what this reads; one that streams is read by ``stream_choices``.
    """
    with gateway.http() as http:
        if request.get("stream"):
            with http.stream("POST", "/v1/chat/completions", json=request) as response:
                assert response.status_code != 200, "this helper reads refusals only; stream with stream_choices"
                return response.status_code, response.headers["x-request-id"], response.read() and response.json()
        response = http.post("/v1/chat/completions", json=request)
        return response.status_code, response.headers["x-request-id"], response.json()


def judged(gateway: RunningGateway, database_url: str, request_id: str) -> tuple[list[ev.Event], RequestState]:
    """The request's events, checked against every invariant, replay and the read model.

    Replay runs with the policy the gateway ran with, as ``phasegate replay --policy``
    would for a gateway configured away from the defaults (docs/incidents.md).
    """
    events = gateway.events(request_id)
    policy = gateway.config.policy
    assert violations(events, policy) == []
    result = replay(events, policy)
    assert result.ok, result.divergence and result.divergence.describe()
    assert fold_disagreements_in(database_url, [request_id]) == []
    return events, fold(events)


def attempts_of(events: list[ev.Event]) -> list[tuple[int, str]]:
    return [(e.attempt, e.replica_id) for e in of(events, ev.AttemptStarted)]  # type: ignore[attr-defined]


def decisions_of(events: list[ev.Event]) -> list[tuple[str, str]]:
    return [(d.action, d.reason) for d in of(events, ev.Decided)]  # type: ignore[attr-defined]


def delivered_text(events: list[ev.Event]) -> str:
    return "".join(e.text or "" for e in of(events, ev.DeltasDelivered))  # type: ignore[attr-defined]


def die_on_first_attempt(workers: list[WorkerProcess], prompt: str, point: str, at_token: int = 0) -> None:
    """Whichever worker takes attempt 1 of the request with ``prompt`` dies there (SIGKILL)."""
    for worker in workers:
        add_fault(worker, action="die", point=point, at_token=at_token, match={"prompt_contains": prompt, "attempt": 1})


def clear_faults(workers: list[WorkerProcess]) -> None:
    """Forget the faults still scripted on the workers alive, so a reference request runs clean.
    A worker that a fault killed may still be exiting when the client has its answer (its
    sockets closed, the process not yet gone): refused, it is waited for and skipped."""
    for worker in workers:
        if not worker.alive():
            continue
        try:
            httpx.delete(worker.base_url + "/admin/faults", timeout=5).raise_for_status()
        except httpx.ConnectError:
            worker.proc.wait(timeout=5)  # dying, or the refusal was a bug: then this raises


def reject_every_first_attempt(workers: list[WorkerProcess], marker: str) -> None:
    """Every attempt 1 of a request whose prompt holds ``marker`` is refused with 503; later ones run."""
    for worker in workers:
        add_fault(worker, action="reject", status=503, times=None, match={"prompt_contains": marker, "attempt": 1})


def assert_the_retry_served_everything(events: list[ev.Event], first: str) -> None:
    """Attempt 1 on ``first`` failed as dead before output; attempt 2, elsewhere, alone published."""
    ((_, one), (_, two)) = attempts_of(events)
    assert one == first and two != first
    (failed,) = of(events, ev.UpstreamFailed)
    assert failed.attempt == 1 and failed.kind is FailureKind.REPLICA_EXITED  # type: ignore[attr-defined]
    retry = [d for d in of(events, ev.Decided) if d.action == "start_attempt" and d.params["attempt"] == 2]  # type: ignore[attr-defined]
    assert len(retry) == 1
    assert retry[0].reason == "replica_exited"  # type: ignore[attr-defined]
    assert retry[0].params["migration"] == "prefill_retry" and first in retry[0].params["exclude_replicas"]  # type: ignore[attr-defined]
    assert [e.attempt for e in of(events, ev.FirstDeltaCommitted)] == [2]  # type: ignore[attr-defined]
    assert {e.attempt for e in of(events, ev.DeltasDelivered)} == {2}  # type: ignore[attr-defined]


def first_replica(events: list[ev.Event]) -> str:
    return attempts_of(events)[0][1]


# --- a whole (non-streamed) answer, retried --------------------------------------------------------


@pytest.mark.parametrize(("point", "at_token"), [("prefill", 0), ("after_frame", 3)])
def test_a_whole_answer_is_retried_when_the_first_replica_dies_before_the_client_got_anything(
    database_url: str, fresh_pair: list[WorkerProcess], unique_prompt: Callable[[str], str], point: str, at_token: int
) -> None:
    """``stream: false``: nothing reaches the client before the answer is whole, so even a
    replica that died after four tokens were generated (and read by the gateway) is retried."""
    prompt = unique_prompt("whole answer")
    die_on_first_attempt(fresh_pair, prompt, point, at_token)
    with running_gateway(database_url, fresh_pair, timeouts=TIMEOUTS) as gateway:
        client = gateway.openai()
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, seed=5
        )
        completion = raw.parse()
        request_id = raw.headers["x-request-id"]
        clear_faults(fresh_pair)
        reference = client.chat.completions.create(  # what the surviving replica says to it
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, seed=5
        )
        events, state = judged(gateway, database_url, request_id)
    # the client: one complete answer, the survivor's own, nothing of the dead attempt
    (choice,) = completion.choices
    assert choice.message.content == reference.choices[0].message.content != ""
    assert choice.finish_reason == "length" and completion.usage is not None
    assert completion.usage.completion_tokens == MAX_TOKENS
    # the log: two attempts, the retry decision, the answer delivered by the second alone
    assert state.outcome is Outcome.COMPLETED
    assert_the_retry_served_everything(events, first_replica(events))
    if at_token > 0:  # attempt 1 really had produced output when it died
        assert 1 in {e.attempt for e in of(events, ev.FirstTokenReceived)}  # type: ignore[attr-defined]
    assert delivered_text(events) == choice.message.content
    assert state.delivered_output_tokens == completion.usage.completion_tokens
    row = read_model_row(database_url, request_id)
    assert (row["outcome"], row["attempts"], row["first_delta_attempt"]) == ("completed", 2, 2)
    assert row["replicas_tried"] == [replica for _, replica in attempts_of(events)]
    assert row["delivered_output_tokens"] == MAX_TOKENS


# --- the per-request retry budget: max_attempts ----------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_when_max_attempts_are_spent_before_output_the_client_gets_a_retryable_502(
    database_url: str, fresh_pair: list[WorkerProcess], unique_prompt: Callable[[str], str], stream: bool
) -> None:
    prompt = unique_prompt("both die")
    for worker in fresh_pair:  # each replica dies on the first attempt of this request it sees
        add_fault(worker, action="die", point="prefill", match={"prompt_contains": prompt})
    with running_gateway(database_url, fresh_pair, timeouts=TIMEOUTS) as gateway:
        status, request_id, answer = post(gateway, body(prompt, stream=stream))
        events, state = judged(gateway, database_url, request_id)
    assert status == 502, answer
    error = answer["error"]
    assert (error["code"], error["partial_output"], error["retryable"]) == ("upstream_unavailable", False, True)
    assert error["delivered_output_tokens"] == 0 and error["request_id"] == request_id
    # the log: both replicas tried once, both dead, then the policy gave up
    assert [a for a, _ in attempts_of(events)] == [1, 2]
    assert len({r for _, r in attempts_of(events)}) == 2
    failures = of(events, ev.UpstreamFailed)
    assert [(f.attempt, f.kind) for f in failures] == [(1, FailureKind.REPLICA_EXITED), (2, FailureKind.REPLICA_EXITED)]  # type: ignore[attr-defined]
    assert decisions_of(events)[-1] == ("fail_request", "retry_budget_exhausted")
    assert not of(events, ev.FirstDeltaCommitted) and not of(events, ev.DeltasDelivered)
    (terminal,) = of(events, ev.RequestFailed)
    assert (terminal.code, terminal.partial_output, terminal.retryable) == ("upstream_unavailable", False, True)  # type: ignore[attr-defined]
    assert terminal.delivered_output_tokens == 0 == state.delivered_output_tokens  # type: ignore[attr-defined]
    row = read_model_row(database_url, request_id)
    assert (row["outcome"], row["error_code"], row["attempts"]) == ("failed", "upstream_unavailable", 2)
    assert row["first_delta_attempt"] is None and row["delivered_output_tokens"] == 0


def test_max_attempts_one_means_no_retry_at_all(
    database_url: str, sim_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    marker = unique_prompt("single shot")
    reject_every_first_attempt(sim_pair, marker)
    with running_gateway(database_url, sim_pair, timeouts=TIMEOUTS, policy=PolicyConfig(max_attempts=1)) as gateway:
        status, request_id, answer = post(gateway, body(marker))
        events, _ = judged(gateway, database_url, request_id)
    assert status == 502 and answer["error"]["code"] == "upstream_unavailable"
    assert answer["error"]["retryable"] is True and answer["error"]["partial_output"] is False
    assert of(events, ev.RequestAccepted)[0].max_attempts == 1  # type: ignore[attr-defined]
    assert len(attempts_of(events)) == 1
    assert decisions_of(events) == [("start_attempt", "request_accepted"), ("fail_request", "retry_budget_exhausted")]


def test_a_log_written_under_max_attempts_one_replays_from_the_log_alone(
    database_url: str, sim_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    """docs/design.md §3/§5: the request's retry budget is in its RequestAccepted event and every
    decision is a pure function of the log, so replay should need nothing else."""
    marker = unique_prompt("budget in the log")
    reject_every_first_attempt(sim_pair, marker)
    with running_gateway(database_url, sim_pair, timeouts=TIMEOUTS, policy=PolicyConfig(max_attempts=1)) as gateway:
        status, request_id, _ = post(gateway, body(marker))
        events = gateway.events(request_id)
    assert status == 502 and of(events, ev.RequestAccepted)[0].max_attempts == 1  # type: ignore[attr-defined]
    assert replay(events, gateway.config.policy).ok  # with the gateway's own config it agrees
    result = replay(events)  # as `phasegate replay REQUEST_ID` runs it, with no --policy
    assert result.ok, result.divergence and result.divergence.describe()


# --- the global retry budget ------------------------------------------------------------------------


def test_the_global_retry_budget_retries_one_request_then_denies_the_next(
    database_url: str, sim_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    """One retry in the bucket, refilled far too slowly to matter: the first request whose
    attempt 1 is refused is retried; the second is denied and fails retryable, as a 503."""
    marker = unique_prompt("storm")
    reject_every_first_attempt(sim_pair, marker)
    with running_gateway(
        database_url, sim_pair, timeouts=TIMEOUTS, retry_budget_burst=1, retry_budget_per_s=0.0001
    ) as gateway:
        first_status, first_id, first_answer = post(gateway, body(f"{marker} one"))
        second_status, second_id, second_answer = post(gateway, body(f"{marker} two", stream=True))
        first_events, first_state = judged(gateway, database_url, first_id)
        second_events, second_state = judged(gateway, database_url, second_id)
    # the first request took the one retry and was answered
    assert first_status == 200 and first_answer["choices"][0]["message"]["content"]
    assert first_state.outcome is Outcome.COMPLETED and len(attempts_of(first_events)) == 2
    assert not of(first_events, ev.RetryBudgetDenied)
    assert delivered_text(first_events) == first_answer["choices"][0]["message"]["content"]
    # the second: its retry was denied before any replica was asked again
    assert second_status == 503, second_answer
    error = second_answer["error"]
    assert (error["code"], error["partial_output"], error["retryable"]) == ("retry_budget_exhausted", False, True)
    assert error["delivered_output_tokens"] == 0 and error["request_id"] == second_id
    (denied,) = of(second_events, ev.RetryBudgetDenied)
    assert denied.scope == "global"  # type: ignore[attr-defined]
    assert len(attempts_of(second_events)) == 1  # nothing started after the denial
    (failed,) = of(second_events, ev.UpstreamFailed)
    assert failed.kind is FailureKind.REJECTED  # type: ignore[attr-defined]
    assert decisions_of(second_events)[-1] == ("fail_request", "global_retry_budget_denied")
    (terminal,) = of(second_events, ev.RequestFailed)
    assert (terminal.code, terminal.partial_output, terminal.retryable) == ("retry_budget_exhausted", False, True)  # type: ignore[attr-defined]
    assert terminal.delivered_output_tokens == 0 == second_state.delivered_output_tokens  # type: ignore[attr-defined]
    assert read_model_row(database_url, second_id)["error_code"] == "retry_budget_exhausted"


# --- the cost guard ----------------------------------------------------------------------------------

COST_LIMIT = 40  # prompt tokens a retry may prefill


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_the_cost_guard_fails_a_long_prompt_fast_and_retries_a_short_one(
    database_url: str, sim_pair: list[WorkerProcess], unique_prompt: Callable[[str], str], stream: bool
) -> None:
    marker = unique_prompt("costly")
    reject_every_first_attempt(sim_pair, marker)
    policy = PolicyConfig(retry_max_prompt_tokens=COST_LIMIT)
    long_prompt = f"{marker} " + " ".join(["tokens"] * (3 * COST_LIMIT))
    with running_gateway(database_url, sim_pair, timeouts=TIMEOUTS, policy=policy) as gateway:
        short_status, short_id, short_answer = post(gateway, body(f"{marker} short"))
        long_status, long_id, long_answer = post(gateway, body(long_prompt, stream=stream))
        short_events, short_state = judged(gateway, database_url, short_id)
        long_events, long_state = judged(gateway, database_url, long_id)
    short_tokens = of(short_events, ev.RequestAccepted)[0].prompt_tokens  # type: ignore[attr-defined]
    long_tokens = of(long_events, ev.RequestAccepted)[0].prompt_tokens  # type: ignore[attr-defined]
    assert short_tokens <= COST_LIMIT < long_tokens, "the prompts do not straddle the limit"
    # under the limit: an ordinary retry, one answer
    assert short_status == 200 and short_state.outcome is Outcome.COMPLETED
    assert len(attempts_of(short_events)) == 2
    assert delivered_text(short_events) == short_answer["choices"][0]["message"]["content"] != ""
    # over it: no second prefill, a managed error at once
    assert long_status == 503, long_answer
    error = long_answer["error"]
    assert (error["code"], error["partial_output"], error["retryable"]) == ("retry_cost_exceeded", False, True)
    assert error["delivered_output_tokens"] == 0 and error["request_id"] == long_id
    assert len(attempts_of(long_events)) == 1
    assert decisions_of(long_events)[-1] == ("fail_request", "retry_cost_guard")
    (terminal,) = of(long_events, ev.RequestFailed)
    assert (terminal.code, terminal.partial_output, terminal.retryable) == ("retry_cost_exceeded", False, True)  # type: ignore[attr-defined]
    assert terminal.delivered_output_tokens == 0 == long_state.delivered_output_tokens  # type: ignore[attr-defined]
    assert not of(long_events, ev.DeltasDelivered)


# --- n > 1 -----------------------------------------------------------------------------------------

N_CHOICES = 2


def reference_choices(gateway: RunningGateway, workers: list[WorkerProcess], prompt: str) -> dict[int, str]:
    """What a healthy replica answers to ``prompt`` with two choices (every replica answers the same)."""
    clear_faults(workers)
    status, _, answer = post(gateway, body(prompt, n=N_CHOICES))
    assert status == 200, answer
    return {c["index"]: c["message"]["content"] for c in answer["choices"]}


@pytest.mark.parametrize(
    ("stream", "point", "at_token"),
    [(True, "prefill", 0), (True, "before_frame", 0), (False, "after_frame", 3)],
    ids=["streamed-prefill", "streamed-before-first-frame", "whole-mid-generation"],
)
def test_several_choices_are_retried_whole_when_the_replica_dies_before_the_first_delta(
    database_url: str,
    fresh_pair: list[WorkerProcess],
    unique_prompt: Callable[[str], str],
    stream: bool,
    point: str,
    at_token: int,
) -> None:
    prompt = unique_prompt("two choices")
    die_on_first_attempt(fresh_pair, prompt, point, at_token)
    with running_gateway(database_url, fresh_pair, timeouts=TIMEOUTS) as gateway:
        if stream:
            received = stream_choices(gateway.url, body(prompt, n=N_CHOICES))
            transcript = received.transcript
            request_id, texts = transcript.request_id, received.texts
            assert transcript.status == 200 and transcript.error is None and transcript.done
            assert received.finish_reasons == dict.fromkeys(range(N_CHOICES), "length")
        else:
            status, request_id, answer = post(gateway, body(prompt, n=N_CHOICES))
            assert status == 200, answer
            texts = {c["index"]: c["message"]["content"] for c in answer["choices"]}
            assert [c["finish_reason"] for c in answer["choices"]] == ["length"] * N_CHOICES
        reference = reference_choices(gateway, fresh_pair, prompt)
        events, state = judged(gateway, database_url, request_id)
        if stream:
            check_request(events, transcript)
    # the client: n complete choices, each the survivor's own, distinct from one another
    assert texts == reference and len(set(texts.values())) == N_CHOICES and "" not in texts.values()
    # the log: the retry, and every choice delivered by attempt 2 alone
    assert state.outcome is Outcome.COMPLETED
    assert of(events, ev.RequestAccepted)[0].n == N_CHOICES  # type: ignore[attr-defined]
    assert_the_retry_served_everything(events, first_replica(events))
    assert state.delivered_output_tokens == N_CHOICES * MAX_TOKENS
    assert sorted(delivered_text(events)) == sorted("".join(reference.values()))  # same text, in delivery order


def test_several_choices_interrupted_after_the_first_delta_end_with_the_final_error(
    database_url: str, fresh_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt("two choices cut")
    frames = 4  # the replica publishes token frames 0..3 (of either choice), then dies
    die_on_first_attempt(fresh_pair, prompt, "after_frame", frames - 1)
    with running_gateway(database_url, fresh_pair, timeouts=TIMEOUTS) as gateway:
        received: ChoiceTranscript = stream_choices(gateway.url, body(prompt, n=N_CHOICES))
        transcript = received.transcript
        reference = reference_choices(gateway, fresh_pair, prompt)
        events, state = judged(gateway, database_url, transcript.request_id)
        check_request(events, transcript)
    # the client: what it got of each choice is a prefix of that choice, then the final error
    assert transcript.status == 200 and transcript.done and transcript.error is not None
    error = transcript.error
    assert (error["code"], error["partial_output"], error["retryable"]) == ("upstream_decode_interrupted", True, False)
    assert error["request_id"] == transcript.request_id
    got = sum(len(parts) for parts in received.deltas.values())
    assert error["delivered_output_tokens"] == got == len(transcript.contents) == frames
    for choice, text in received.texts.items():
        assert reference[choice].startswith(text) and text != reference[choice]
    assert received.finish_reasons == {}  # no choice was finished
    # the log: one attempt, no second generation, the terminal event says what the client got
    assert len(attempts_of(events)) == 1
    assert not [d for d in of(events, ev.Decided) if d.action == "start_attempt" and d.params["attempt"] > 1]  # type: ignore[attr-defined]
    (terminal,) = of(events, ev.RequestFailed)
    assert (terminal.code, terminal.partial_output, terminal.retryable) == ("upstream_decode_interrupted", True, False)  # type: ignore[attr-defined]
    assert terminal.delivered_output_tokens == got == state.delivered_output_tokens  # type: ignore[attr-defined]
    row = read_model_row(database_url, transcript.request_id)
    assert (row["outcome"], row["attempts"], row["first_delta_attempt"]) == ("failed", 1, 1)
    assert row["delivered_output_tokens"] == got and row["delivered_deltas"] == got
