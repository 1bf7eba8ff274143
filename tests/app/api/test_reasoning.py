"""Reasoning through the gateway (docs/design.md §14): output like any other.

The upstream is the scripted OpenAI-compatible server in its own process
(tests/support/scripted_upstream.py), streaming reasoning as vLLM's reasoning parser does:
``delta.reasoning`` pieces, then the think block's end, a token with no text (``delta: {}``
with its log probabilities), then content. vLLM's own server, with the tiny model and a real
parser, is the differential suite's (tests/compat/). Each test judges by what the client
received and what the log says, per request.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from app.api.resume.log import deltas_of
from app.config import ReplicaConfig, Timeouts
from statemachine import events as ev
from statemachine.replay import replay
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.scripted_upstream import ScriptedUpstream, answer, running_scripted_upstream
from tests.support.transcript import check_request, of, resume_stream, stream_chat

TIMEOUTS = Timeouts(stall_s=10.0, lease_ttl_s=2.0, first_token_soft_s=10.0, first_token_hard_s=30.0)
PROMPT = "think first"
MESSAGES = [{"role": "user", "content": PROMPT}]
THOUGHT = 3  # words of reasoning


def body(max_tokens: int = 6, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, **fields}


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    with running_scripted_upstream(token_delay_s=0.01) as running:
        yield running


@pytest.fixture
def gateway(database_url: str, upstream: ScriptedUpstream) -> Iterator[RunningGateway]:
    upstream.script()
    replicas = [ReplicaConfig(id="u1", url=upstream.base_url, kind="openai")]
    with running_gateway(database_url, replicas, timeouts=TIMEOUTS, resume_grace_s=30) as running:
        yield running


def logged(events: list[ev.Event], cls: type[ev.Event] = ev.DeltasDelivered) -> list[tuple[str, str]]:
    """Each delta's field and text, as the log holds them: delivered, or produced while no
    client was attached."""
    batches = of(events, cls)
    return [(d.key, d.text) for batch in batches for d in deltas_of(batch)]  # type: ignore[arg-type]


def test_reasoning_streams_before_the_content_and_the_log_holds_each_deltas_field(
    gateway: RunningGateway, upstream: ScriptedUpstream
) -> None:
    upstream.script({"reasoning": THOUGHT})
    transcript = stream_chat(gateway.url, body(logprobs=True))
    events = gateway.events(transcript.request_id)
    state = check_request(events, transcript)  # the client's deltas are the log's, one by one
    words = answer(PROMPT, 6)
    assert transcript.kinds == ["reasoning"] * THOUGHT + [""] + ["content"] * 3
    assert transcript.content == "".join(words[THOUGHT:]) and transcript.error is None and transcript.done
    assert logged(events) == [("reasoning", w) for w in words[:THOUGHT]] + [("", "")] + [
        ("content", w) for w in words[THOUGHT:]
    ]
    # reasoning is output: the first reasoning delta is the commit point, and it counts
    first = of(events, ev.DeltasDelivered)[0]
    commit = of(events, ev.FirstDeltaCommitted)[0]
    assert events.index(commit) < events.index(first)
    assert state.outcome is Outcome.COMPLETED and state.delivered_output_tokens == 7  # the think end is a token
    assert replay(events).ok


def test_a_whole_answer_carries_the_reasoning_and_every_tokens_log_probability(
    gateway: RunningGateway, upstream: ScriptedUpstream
) -> None:
    upstream.script({"reasoning": THOUGHT})
    raw = gateway.openai().chat.completions.with_raw_response.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        logprobs=True,  # type: ignore[arg-type]
    )
    message = raw.parse().choices[0].message
    words = answer(PROMPT, 6)
    assert (message.model_extra or {}).get("reasoning") == "".join(words[:THOUGHT])
    assert message.content == "".join(words[THOUGHT:])
    entries = raw.parse().choices[0].logprobs.content  # type: ignore[union-attr]
    assert [e.token for e in entries] == [*words[:THOUGHT], "</think>", *words[THOUGHT:]]
    events = gateway.events(raw.headers["x-request-id"])
    assert fold(events).outcome is Outcome.COMPLETED and replay(events).ok


def test_all_reasoning_and_no_content_is_content_null_as_vllm_says(
    gateway: RunningGateway, upstream: ScriptedUpstream
) -> None:
    upstream.script({"reasoning": 10})
    message = gateway.openai().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4).choices[0].message  # type: ignore[arg-type]
    assert message.content is None and (message.model_extra or {}).get("reasoning") == "".join(answer(PROMPT, 4))


def test_a_replica_that_dies_after_the_first_reasoning_delta_ends_the_stream_with_what_was_sent(
    database_url: str,
) -> None:
    with running_scripted_upstream(token_delay_s=0.01) as doomed, running_scripted_upstream() as spare:
        replicas = [
            ReplicaConfig(id="u1", url=doomed.base_url, kind="openai"),
            ReplicaConfig(id="u2", url=spare.base_url, kind="openai"),
        ]
        with running_gateway(database_url, replicas, timeouts=TIMEOUTS) as gateway:
            doomed.script({"reasoning": THOUGHT, "die_at": 0, "point": "after_frame"})
            transcript = stream_chat(gateway.url, body())
            events = gateway.events(transcript.request_id)
            state = check_request(events, transcript)
    # the client: the reasoning it got, then the final error that counts it; no second answer
    assert transcript.kinds == ["reasoning"] and transcript.done
    error = transcript.error
    assert error is not None and error["code"] == "upstream_decode_interrupted"
    assert error["partial_output"] is True and error["delivered_output_tokens"] == 1
    # the log: what the client got, one attempt, the terminal event as the client was told
    assert logged(events) == [("reasoning", answer(PROMPT, 6)[0])]
    assert [e.replica_id for e in of(events, ev.AttemptStarted)] == ["u1"]  # type: ignore[attr-defined]
    assert state.outcome is Outcome.FAILED and state.delivered_output_tokens == 1
    assert replay(events).ok


def test_a_client_that_left_in_the_middle_of_reasoning_resumes_the_rest(
    gateway: RunningGateway, upstream: ScriptedUpstream
) -> None:
    upstream.script({"reasoning": 5})
    first = stream_chat(gateway.url, body(max_tokens=10), on_delta=lambda n: n == 2)
    assert first.kinds == ["reasoning", "reasoning"] and not first.done
    gateway.settle()
    resumed = resume_stream(gateway.url, first.request_id, 1)
    events = gateway.events(first.request_id)
    words = answer(PROMPT, 10)
    assert resumed.status == 200 and resumed.event_ids[:8] == list(range(2, 10))
    assert resumed.kinds == ["reasoning"] * 3 + ["content"] * 5  # the rest, each under its field
    assert first.text + resumed.text == "".join(words)
    # the log: every delta once under its field, delivered to the first client or produced
    # while none was attached (docs/design.md §12)
    by_index = {
        d.index: (d.key, d.text)
        for batch in [*of(events, ev.DeltasDelivered), *of(events, ev.DeltasProduced)]
        for d in deltas_of(batch)  # type: ignore[arg-type]
    }
    assert [by_index[i] for i in sorted(by_index)] == [("reasoning", w) for w in words[:5]] + [
        ("content", w) for w in words[5:]
    ]
    assert replay(events).ok


def test_under_the_digest_policy_reasoning_is_kept_as_content_is_a_digest_and_its_field(
    database_url: str, upstream: ScriptedUpstream
) -> None:
    """Reasoning follows the content policy: no text in the log, its digest and its field;
    so a resume is refused as for any content."""
    upstream.script({"reasoning": THOUGHT})
    replicas = [ReplicaConfig(id="u1", url=upstream.base_url, kind="openai")]
    with running_gateway(database_url, replicas, timeouts=TIMEOUTS, content_policy="digest") as gateway:
        transcript = stream_chat(gateway.url, body())
        events = gateway.events(transcript.request_id)
        refused = resume_stream(gateway.url, transcript.request_id, 0)
    assert transcript.kinds == ["reasoning"] * THOUGHT + ["content"] * 3 and transcript.done
    batches = of(events, ev.DeltasDelivered)
    assert all(b.text is None and b.text_sha256 for b in batches)  # type: ignore[attr-defined]
    keys = [key for b in batches for key in (b.fields or ("content",) * (b.to_index - b.from_index))]  # type: ignore[attr-defined]
    assert keys == ["reasoning"] * THOUGHT + ["content"] * 3
    assert fold(events).delivered_output_tokens == 6
    assert refused.status == 409 and refused.error is not None and refused.error["code"] == "resume_unavailable"
