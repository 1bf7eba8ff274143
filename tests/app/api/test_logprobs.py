"""Log probabilities through the gateway, as vLLM serves them, read by the real ``openai``
client: streamed in the chunk format the SDK parses, whole, and for legacy completions.
The sim's log probabilities are a function of each token, so a stream and a whole answer
to the same request must agree token by token."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from app.config import ReplicaConfig
from statemachine import events as ev
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.scripted_upstream import running_scripted_upstream
from tests.support.transcript import of
from tests.support.workers import WorkerProcess


def test_chat_logprobs_stream_and_whole_agree(gateway: RunningGateway, unique_prompt: Callable[[str], str]) -> None:
    client = gateway.openai()
    messages = [{"role": "user", "content": unique_prompt("probable")}]
    options = {"model": MODEL, "messages": messages, "max_tokens": 12, "seed": 5, "logprobs": True, "top_logprobs": 3}
    streamed = []
    text = ""
    for chunk in client.chat.completions.create(stream=True, **options):  # type: ignore[call-overload]
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None:
                streamed.extend(choice.logprobs.content or [])
    whole = client.chat.completions.create(**options)  # type: ignore[call-overload]
    content = whole.choices[0].logprobs.content
    assert whole.choices[0].message.content == text
    assert "".join(entry.token for entry in streamed) == text  # one entry per token, in order
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)


def test_no_logprobs_unless_asked(gateway: RunningGateway) -> None:
    answer = gateway.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "plain"}], max_tokens=4
    )
    assert answer.choices[0].logprobs is None


def test_completion_logprobs_in_the_legacy_columns(gateway: RunningGateway) -> None:
    client = gateway.openai()
    streamed_tokens: list[str] = []
    offsets: list[int] = []
    text = ""
    for chunk in client.completions.create(model=MODEL, prompt="columns", max_tokens=8, logprobs=2, stream=True):
        choice = chunk.choices[0]
        if choice.logprobs is not None:
            streamed_tokens += choice.logprobs.tokens or []
            offsets += choice.logprobs.text_offset or []
        text += choice.text
    assert "".join(streamed_tokens) == text
    assert offsets == [len("".join(streamed_tokens[:i])) for i in range(len(streamed_tokens))]
    whole = client.completions.create(model=MODEL, prompt="columns", max_tokens=8, logprobs=2)
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens == streamed_tokens and logprobs.text_offset == offsets
    assert all(
        len(top) <= 2 and token in top for token, top in zip(logprobs.tokens, logprobs.top_logprobs or [], strict=True)
    )


@pytest.mark.parametrize(
    ("endpoint", "options", "param"),
    [
        ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"logprobs": 3}, "logprobs"),
        ("completions", {"logprobs": 6}, "logprobs"),
        ("completions", {"logprobs": True}, "logprobs"),
    ],
)
def test_bad_logprobs_are_named(gateway: RunningGateway, endpoint: str, options: dict[str, object], param: str) -> None:
    client = gateway.openai()
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], extra_body=options)
        else:
            client.completions.create(model=MODEL, prompt="x", extra_body=options)
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == param


def test_an_openai_compatible_replicas_logprobs_are_passed_on(database_url: str) -> None:
    with running_scripted_upstream() as upstream:
        replicas = [ReplicaConfig(id="vllm-serve", url=upstream.base_url, kind="openai")]
        with running_gateway(database_url, replicas) as gateway:
            client = gateway.openai()
            chat = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2
            )
            asked = upstream.last_body
            completion = client.completions.create(model=MODEL, prompt="hi", logprobs=1)
    assert asked is not None and (asked["logprobs"], asked["top_logprobs"]) == (True, 2)
    content = chat.choices[0].logprobs.content
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    assert {(e.logprob, tuple((t.token, t.logprob) for t in e.top_logprobs)) for e in content} == {
        (-0.5, ((e.token, -0.5), ("~", -1.5))) for e in content
    }
    legacy = completion.choices[0].logprobs
    assert legacy is not None and "".join(legacy.tokens) == completion.choices[0].text
    assert set(legacy.token_logprobs) == {-0.5}


def client_logprobs(stream: Any) -> list[tuple[str, float, tuple[tuple[str, float], ...]]]:
    got = []
    for chunk in stream:
        for choice in chunk.choices:
            for e in (choice.logprobs and choice.logprobs.content) or ():
                got.append((e.token, e.logprob, tuple((t.token, t.logprob) for t in e.top_logprobs)))
    return got


@pytest.mark.parametrize("policy", ["full", "digest", "none"])
def test_logprobs_are_recorded_with_the_text_under_the_content_policy(
    database_url: str, sim_pair: list[WorkerProcess], policy: str
) -> None:
    with running_gateway(database_url, sim_pair, content_policy=policy) as gateway:
        stream = gateway.openai().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "kept?"}],
            max_tokens=10,
            stream=True,
            logprobs=True,
            top_logprobs=2,
        )
        received = client_logprobs(stream)
        request_id = stream.response.headers["x-request-id"]
        events = gateway.events(request_id)
        resumed = [] if policy != "full" else resumed_logprobs(gateway, request_id, after=3)
    (accepted,) = of(events, ev.RequestAccepted)
    assert accepted.logprobs == 2  # type: ignore[attr-defined]  # what was asked: the skeleton, always
    batches = of(events, ev.DeltasDelivered)
    assert len(received) == 10 and batches
    if policy == "full":
        recorded = [entry for batch in batches for delta in batch.logprobs for entry in delta]  # type: ignore[attr-defined]
        assert recorded == received
        assert resumed == received[4:]  # resumed from the log, as the client first got them
    else:
        assert all(batch.logprobs is None for batch in batches)  # type: ignore[attr-defined]


def resumed_logprobs(gateway: RunningGateway, request_id: str, after: int) -> list[Any]:
    got: list[Any] = []
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        path = f"/v1/requests/{request_id}/stream"
        with http.stream("GET", path, headers={"last-event-id": str(after)}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[6:]).get("choices", ()):
                    for e in (choice.get("logprobs") or {}).get("content", ()):
                        top = tuple((t["token"], t["logprob"]) for t in e["top_logprobs"])
                        got.append((e["token"], e["logprob"], top))
    return got
