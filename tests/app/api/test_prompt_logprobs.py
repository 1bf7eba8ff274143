"""The prompt's log probabilities (vLLM's ``prompt_logprobs``) through sim workers, read by the
real ``openai`` client: a whole answer carries them as vLLM lays them out (chat: once, at the
top; completions: per choice), asked or by an echo's default; the log holds them with each
choice's first delta, and an idempotent POST rebuilt from the log gives the same answer; a
stream never carries them, and asks for more than 0 are refused as vLLM refuses them
(docs/design.md §3, §14)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from app.config import ReplicaConfig
from app.worker.sim_tokens import prompt_logprobs
from statemachine import events as ev
from statemachine.state import fold
from tests.support import scripted_upstream
from tests.support.audit import fold_disagreements_in
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.scripted_upstream import running_scripted_upstream
from tests.support.transcript import of
from tests.support.workers import WorkerProcess


def vllm_layout(said: list[Any]) -> list[dict[str, dict[str, Any]] | None]:
    """The sim's prompt log probabilities as vLLM's whole answer lays them out."""
    return [
        None
        if place is None
        else {str(tid): {"logprob": lp, "rank": rank, "decoded_token": text} for tid, lp, rank, text in place}
        for place in said
    ]


def logged(events: list[ev.Event]) -> dict[int, Any]:
    """Each choice's prompt log probabilities, as the log holds them (one entry a choice)."""
    said: dict[int, Any] = {}
    for batch in of(events, ev.DeltasDelivered):
        for choice, logprobs in batch.prompt_logprobs:  # type: ignore[attr-defined]
            assert choice not in said  # said once, with the choice's first delta
            said[choice] = logprobs
    return said


def as_json(said: Any) -> Any:
    return [None if place is None else [list(entry) for entry in place] for place in said]


def test_a_chat_answer_carries_the_prompts_log_probabilities_once(
    gateway: RunningGateway, database_url: str, unique_prompt: Any
) -> None:
    content = unique_prompt("what comes first")
    answer = gateway.openai().chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=5,
        n=2,
        extra_body={"prompt_logprobs": 2},
    )
    body = answer.http_response.json()
    expected = prompt_logprobs(f"user: {content}", 2)  # the sim's rendered prompt
    assert body["prompt_logprobs"] == vllm_layout(expected)
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"][1]) == 3  # the token and 2 more
    assert all("prompt_logprobs" not in choice for choice in body["choices"])
    request_id = answer.headers["x-request-id"]
    events = gateway.events(request_id)
    assert {choice: as_json(said) for choice, said in logged(events).items()} == {0: expected, 1: expected}
    assert fold_disagreements_in(database_url, [request_id]) == []
    # the same POST again (its idempotency key): the answer rebuilt from the log is the same
    key = {"Idempotency-Key": f"k-{request_id}"}
    options = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 5}
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        first = http.post("/v1/chat/completions", json=options | {"prompt_logprobs": 0}, headers=key).json()
        again = http.post("/v1/chat/completions", json=options | {"prompt_logprobs": 0}, headers=key).json()
    assert first == again and first["prompt_logprobs"] == vllm_layout(prompt_logprobs(f"user: {content}", 0))


def test_a_completion_echo_with_logprobs_carries_them_per_choice(gateway: RunningGateway) -> None:
    client = gateway.openai()
    answer = client.completions.with_raw_response.create(
        model=MODEL, prompt=["first prompt here", "second one"], max_tokens=4, echo=True, logprobs=1
    )
    choices = answer.http_response.json()["choices"]
    assert [c["prompt_logprobs"] for c in choices] == [
        vllm_layout(prompt_logprobs("first prompt here", 1)),
        vllm_layout(prompt_logprobs("second one", 1)),
    ]
    plain = client.completions.with_raw_response.create(model=MODEL, prompt="no echo", max_tokens=4, logprobs=1)
    assert "prompt_logprobs" not in plain.http_response.json()["choices"][0]  # not asked: none, as vLLM's null
    assert of(gateway.events(plain.headers["x-request-id"]), ev.DeltasDelivered)[0].prompt_logprobs == ()  # type: ignore[attr-defined]


def test_a_chat_echo_asks_for_them_by_default(gateway: RunningGateway) -> None:
    body = (
        gateway.openai()
        .chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "echo me"}], max_tokens=3, extra_body={"echo": True}
        )
        .http_response.json()
    )
    assert body["prompt_logprobs"] == vllm_layout(prompt_logprobs("user: echo me", 0))  # top_logprobs' 0


def test_a_stream_never_carries_them_and_refuses_more_than_none(gateway: RunningGateway) -> None:
    client = gateway.openai()
    messages = [{"role": "user", "content": "streamed"}]
    for asked in (1, -1):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=MODEL, messages=messages, stream=True, extra_body={"prompt_logprobs": asked}
            )
        assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "prompt_logprobs"
        assert "stream" in caught.value.body["message"]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, stream=True, extra_body={"prompt_logprobs": 0}
    )
    chunks = [chunk.model_dump() for chunk in stream]
    assert chunks and not any("prompt_logprobs" in chunk for chunk in chunks)
    events = gateway.events(stream.response.headers["x-request-id"])
    assert all(batch.prompt_logprobs == () for batch in of(events, ev.DeltasDelivered))  # type: ignore[attr-defined]


@pytest.mark.parametrize(("asked", "why"), [(-2, "positive value or -1"), ("1", "positive value or -1"), (21, "max")])
def test_bad_prompt_logprobs_are_named(gateway: RunningGateway, asked: object, why: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.openai().completions.create(
            model=MODEL, prompt="x", max_tokens=2, extra_body={"prompt_logprobs": asked}
        )
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == "prompt_logprobs" and why in body["message"]


def test_under_the_digest_policy_the_log_keeps_none(database_url: str, sim_pair: list[WorkerProcess]) -> None:
    with running_gateway(database_url, sim_pair, content_policy="digest") as gateway:
        answer = gateway.openai().chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": "kept?"}],
            max_tokens=3,
            extra_body={"prompt_logprobs": 1},
        )
        events = gateway.events(answer.headers["x-request-id"])
    assert answer.http_response.json()["prompt_logprobs"][1]  # the client got them
    assert logged(events) == {}  # decoded prompt tokens are content (docs/design.md §13)


def test_an_openai_replica_is_asked_unstreamed_only_for_them(database_url: str) -> None:
    with running_scripted_upstream() as upstream:
        replicas = [ReplicaConfig(id="vllm-serve", url=upstream.base_url, kind="openai")]
        with running_gateway(database_url, replicas) as gateway:
            client = gateway.openai()
            chat = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "one two three"}], extra_body={"prompt_logprobs": 1}
            )
            asked_whole = upstream.last_body
            echo = client.completions.with_raw_response.create(
                model=MODEL, prompt="four five", echo=True, logprobs=1, max_tokens=3
            )
            echo_asked = upstream.last_body
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "plain"}], max_tokens=3)
            asked_plain = upstream.last_body
            events = gateway.events(chat.headers["x-request-id"])
    assert asked_whole is not None and asked_whole["stream"] is False and "stream_options" not in asked_whole
    assert chat.http_response.json()["prompt_logprobs"] == scripted_upstream.prompt_logprobs("one two three", 1)
    assert chat.parse().choices[0].message.content  # the answer's text, as one delta
    assert echo_asked is not None and echo_asked["stream"] is False and echo_asked["echo"] is True
    echoed = echo.http_response.json()["choices"][0]
    assert echoed["prompt_logprobs"] == scripted_upstream.prompt_logprobs("four five", 1)
    assert asked_plain is not None and asked_plain["stream"] is True  # every other request streamed, as before
    (said,) = [p for batch in of(events, ev.DeltasDelivered) for p in batch.prompt_logprobs]  # type: ignore[attr-defined]
    assert said[0] == 0 and as_json(said[1])[1] == [[3, -1.0, 2, "two"], [98, -0.25, 1, "~"]]
    (completed,) = of(events, ev.RequestCompleted)
    assert fold(events).delivered_output_tokens == completed.usage["completion_tokens"]  # type: ignore[attr-defined]
