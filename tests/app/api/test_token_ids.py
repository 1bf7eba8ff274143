"""Token ids and the prompt's fields (vLLM's ``return_token_ids``, ``return_prompt_text``,
docs/design.md §14): through an OpenAI upstream that sends them where vLLM does, each delta's
``token_ids`` reach the client with it, a chat choice's role chunk carries the prompt's
``prompt_token_ids`` and ``prompt_text`` (a completion's first chunk, its choice's
``prompt_token_ids``), the end-of-sequence id comes in a delta of no text, and the log holds
all of it (``DeltasDelivered`` version 3), so a resumed stream and an idempotent replay give
the client what it was sent, byte for byte. Under the ``digest`` content policy the log
keeps none of it (token ids are content). The same against ``vllm serve`` itself and a vLLM
worker: tests/compat (*return_token_ids*, *return fields*).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from app.api.resume.log import deltas_of
from app.config import ReplicaConfig
from statemachine import events as ev
from statemachine.deltas import NO_TEXT
from statemachine.jsonform import written_as
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.scripted_upstream import (
    ALTERNATIVE_ID,
    EOS,
    ScriptedUpstream,
    answer,
    prompt_token_ids,
    running_scripted_upstream,
    token_id,
)
from tests.support.transcript import of

PROMPT = "name four greek letters"
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": PROMPT}],
    "max_tokens": 6,
    "return_token_ids": True,
    "return_prompt_text": True,
}
COMPLETION = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "return_token_ids": True}
WORDS = answer(PROMPT, 6)
IDS = [token_id(word) for word in WORDS]


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    with running_scripted_upstream() as running:
        yield running


@pytest.fixture
def gateway(database_url: str, upstream: ScriptedUpstream) -> Iterator[RunningGateway]:
    with running_gateway(database_url, [ReplicaConfig(id="u1", url=upstream.base_url, kind="openai")]) as running:
        yield running


def chunks(raw: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]


def data_lines(raw: str) -> list[str]:
    return [line for line in raw.splitlines() if line.startswith(("id: ", "data: "))]


def logged_deltas(gateway: RunningGateway, request_id: str) -> list[Any]:
    events = gateway.events(request_id)
    return [d for e in of(events, ev.DeltasDelivered) for d in deltas_of(e)]  # type: ignore[arg-type]


def test_a_chat_stream_carries_each_deltas_token_ids_and_the_prompts_fields_and_the_log_holds_them(
    gateway: RunningGateway, upstream: ScriptedUpstream
) -> None:
    upstream.script({"finish_reason": "stop"})
    with gateway.http() as http:
        sent = http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert sent.status_code == 200, sent.text
    got = chunks(sent.text)
    role = got[0]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["prompt_token_ids"] == prompt_token_ids(PROMPT)
    assert role["prompt_text"] == f"<|user|>{PROMPT}<|assistant|>"
    deltas = [c["choices"][0] for c in got[1:] if c["choices"] and c["choices"][0]["finish_reason"] is None]
    assert [d["delta"].get("content") for d in deltas] == [*WORDS, None]  # the end-of-sequence id: no text
    assert [d["token_ids"] for d in deltas] == [[i] for i in IDS] + [[EOS]]
    logged = logged_deltas(gateway, sent.headers["x-request-id"])
    assert [list(d.token_ids) for d in logged] == [[i] for i in IDS] + [[EOS]]
    assert [d.key for d in logged][-1] == NO_TEXT and logged[-1].tokens == 1
    said = [d.prompt for d in logged if d.prompt is not None]
    assert said == [(tuple(prompt_token_ids(PROMPT)), f"<|user|>{PROMPT}<|assistant|>")]


def test_a_whole_chat_answer_has_its_token_ids_and_the_prompts_once(
    gateway: RunningGateway, upstream: ScriptedUpstream
) -> None:
    upstream.script({"finish_reason": "stop"})
    with gateway.http() as http:
        body = http.post("/v1/chat/completions", json=CHAT).json()
    assert body["prompt_token_ids"] == prompt_token_ids(PROMPT)
    assert body["prompt_text"] == f"<|user|>{PROMPT}<|assistant|>"
    (choice,) = body["choices"]
    assert choice["token_ids"] == [*IDS, EOS] and choice["message"]["content"] == "".join(WORDS)


def test_a_completions_first_chunk_names_its_prompts_token_ids(gateway: RunningGateway) -> None:
    with gateway.http() as http:
        sent = http.post("/v1/completions", json={**COMPLETION, "stream": True})
        whole = http.post("/v1/completions", json=COMPLETION).json()
    deltas = [c["choices"][0] for c in chunks(sent.text) if c["choices"] and c["choices"][0]["finish_reason"] is None]
    assert deltas[0]["prompt_token_ids"] == prompt_token_ids(PROMPT)
    assert all("prompt_token_ids" not in d for d in deltas[1:])
    assert [d["token_ids"] for d in deltas] == [[i] for i in IDS]
    (choice,) = whole["choices"]
    assert (choice["prompt_token_ids"], choice["token_ids"]) == (prompt_token_ids(PROMPT), IDS)
    assert "prompt_token_ids" not in whole  # a completion's are its choice's


def test_a_resumed_stream_and_an_idempotent_replay_give_what_was_sent(
    gateway: RunningGateway, upstream: ScriptedUpstream
) -> None:
    key = {"idempotency-key": f"ids-{uuid.uuid4().hex}"}
    before = upstream.requests
    with gateway.http() as http:
        sent = http.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=key)
        request_id = sent.headers["x-request-id"]
        from_the_start = http.get(f"/v1/requests/{request_id}/stream")
        resumed = http.get(f"/v1/requests/{request_id}/stream", headers={"last-event-id": "2"})
        replayed = http.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=key)
    original = data_lines(sent.text)
    assert data_lines(from_the_start.text) == original  # the role chunk's prompt fields too
    assert data_lines(resumed.text) == original[original.index("id: 3") :]
    assert data_lines(replayed.text) == original
    assert upstream.requests == before + 1  # the replay came from the log, not the replica


def test_the_digest_policy_keeps_no_token_ids(database_url: str, upstream: ScriptedUpstream) -> None:
    replicas = [ReplicaConfig(id="u1", url=upstream.base_url, kind="openai")]
    with running_gateway(database_url, replicas, content_policy="digest") as gateway, gateway.http() as http:
        sent = http.post("/v1/chat/completions", json={**CHAT, "stream": True})
        events = gateway.events(sent.headers["x-request-id"])
    assert '"token_ids":[' in sent.text and '"prompt_token_ids":[' in sent.text  # the client got them
    batches = of(events, ev.DeltasDelivered)
    assert batches and all(b.text is None and not b.token_ids and not b.prompts for b in batches)  # type: ignore[attr-defined]


def test_tokens_named_by_their_ids_keep_their_texts_bytes_sent_logged_and_resumed(
    gateway: RunningGateway, upstream: ScriptedUpstream
) -> None:
    """``return_tokens_as_token_ids``: vLLM names each token ``token_id:<id>`` and gives a
    chat token's ``bytes`` from its text (an alternative's from its name). The client gets
    them so, whole and streamed; the log keeps the text with the token (``DeltasDelivered``
    version 4), so a resumed stream gives the same bytes."""
    asked = {**CHAT, "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True}
    with gateway.http() as http:
        sent = http.post("/v1/chat/completions", json={**asked, "stream": True})
        whole = http.post("/v1/chat/completions", json=asked).json()
        request_id = sent.headers["x-request-id"]
        resumed = http.get(f"/v1/requests/{request_id}/stream")
    names = [f"token_id:{i}" for i in IDS]
    other = f"token_id:{ALTERNATIVE_ID}"
    streamed = [
        e for c in chunks(sent.text) if c["choices"] for e in (c["choices"][0]["logprobs"] or {}).get("content", [])
    ]
    for entries in (streamed, whole["choices"][0]["logprobs"]["content"]):
        assert [e["token"] for e in entries] == names
        assert [e["bytes"] for e in entries] == [list(word.encode()) for word in WORDS]  # the text's
        assert [[t["bytes"] for t in e["top_logprobs"]] for e in entries] == [
            [list(name.encode()), list(other.encode())]
            for name in names  # an alternative's: its name's
        ]
    assert data_lines(resumed.text) == data_lines(sent.text)
    batches = of(gateway.events(request_id), ev.DeltasDelivered)
    logged = [entry for b in batches for delta in b.logprobs or () for entry in delta]  # type: ignore[attr-defined]
    assert logged == [(name, -0.5, ((name, -0.5), (other, -1.5)), w) for name, w in zip(names, WORDS, strict=True)]
    assert {written_as(b)[0] for b in batches} == {4}
    with gateway.http() as http:  # named by their text, the tokens need no more: written as before
        plain = http.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "stream": True})
    assert {written_as(b)[0] for b in of(gateway.events(plain.headers["x-request-id"]), ev.DeltasDelivered)} == {3}
