"""A whole answer with the prompt's log probabilities (vLLM's ``prompt_logprobs``) whose first
replica dies before the answer is whole, through both replica kinds (a sim worker dies once
its ``prompt_logprobs`` frame and first tokens went out; an ``openai`` replica, asked
unstreamed, dies before it answers): nothing reached the client, so it is retried on the
other replica, and the client gets one answer carrying them once; the log holds them once a
choice, with the final attempt's deltas, and replays (docs/design.md §3, §14)."""

from __future__ import annotations

from typing import Any

from app.worker import sim_tokens
from statemachine import events as ev
from statemachine.replay import replay
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.faults.conftest import Evidence, Fleet
from tests.faults.token_loop import prompt_for, replicas_of
from tests.support import scripted_upstream
from tests.support.gateway import MODEL, RunningGateway
from tests.support.transcript import of


def expected(kind: str, prompt: str) -> list[Any]:
    """The prompt's log probabilities as vLLM's answer lays them out, from each kind's replica."""
    if kind == "openai":
        return scripted_upstream.prompt_logprobs(prompt, 1)
    said = sim_tokens.prompt_logprobs(f"user: {prompt}", 1)
    return [
        None if place is None else {str(t): {"logprob": lp, "rank": r, "decoded_token": d} for t, lp, r, d in place}
        for place in said
    ]


def test_a_replica_killed_before_the_whole_answer_is_retried_and_it_carries_them_once(
    loop_gateway: RunningGateway, live_fleet: Fleet, evidence: Evidence
) -> None:
    prompt = prompt_for("prompt logprobs die")
    live_fleet.fault_first_attempt(prompt, "die", k=1, point="after_frame")
    raw = loop_gateway.openai(max_retries=0).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=6, extra_body={"prompt_logprobs": 1}
    )
    body = raw.http_response.json()
    request_id = raw.headers["x-request-id"]
    loop_gateway.wait_logged(request_id, lambda events: fold(events).outcome is not None)
    events = loop_gateway.logged(request_id)
    evidence.keep(request_id, events, None, {"prompt": prompt})
    assert raw.http_response.status_code == 200 and body["choices"][0]["message"]["content"]
    assert body["prompt_logprobs"] == expected(live_fleet.kind, prompt)
    assert replicas_of(events) == ["r1", "r2"] and [r.alive for r in live_fleet.replicas] == [False, True]
    state = fold(events)
    assert state.outcome is Outcome.COMPLETED
    said = [
        (batch.attempt, choice)  # type: ignore[attr-defined]
        for batch in of(events, ev.DeltasDelivered) + of(events, ev.DeltasProduced)
        for choice, _ in batch.prompt_logprobs  # type: ignore[attr-defined]
    ]
    assert said == [(2, 0)]  # once, with the answer's own attempt
    result = replay(events)
    assert result.ok, result.divergence and result.divergence.describe()
