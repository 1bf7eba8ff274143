"""A completion's batch of prompts through a worker replica (docs/design.md §14): as vLLM's server
answers one, prompt k's ``n`` choices are the answer's choices k·n … k·n + n − 1, each the
answer that prompt alone gets, streamed and whole; the usage counts every prompt's tokens,
and the log holds each choice's deltas and finish. Real sim workers over real sockets; the
same against ``vllm serve`` and a vLLM worker: tests/compat (*completions: a batch of …*).
"""

from __future__ import annotations

import json
from typing import Any

from statemachine import events as ev
from statemachine.state import fold
from tests.support.gateway import MODEL, RunningGateway
from tests.support.transcript import of

PROMPTS = ["the quick brown fox", "a lazy dog"]


def asked(prompt: Any, **more: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "n": 2, **more}


def streamed_texts(raw: str) -> dict[int, str]:
    texts: dict[int, str] = {}
    for line in raw.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return texts


def test_a_batchs_choices_are_each_prompts_own_answers(gateway: RunningGateway) -> None:
    with gateway.http() as http:
        alone = [http.post("/v1/completions", json=asked(prompt)).json() for prompt in PROMPTS]
        whole = http.post("/v1/completions", json=asked(PROMPTS)).json()
        sent = http.post("/v1/completions", json=asked(PROMPTS, stream=True))
    expected = [choice["text"] for answer in alone for choice in answer["choices"]]
    assert [choice["index"] for choice in whole["choices"]] == [0, 1, 2, 3]
    assert [choice["text"] for choice in whole["choices"]] == expected
    assert [choice["finish_reason"] for choice in whole["choices"]] == [
        choice["finish_reason"] for answer in alone for choice in answer["choices"]
    ]
    assert whole["usage"]["prompt_tokens"] == sum(answer["usage"]["prompt_tokens"] for answer in alone)
    assert streamed_texts(sent.text) == dict(enumerate(expected))
    events = gateway.events(sent.headers["x-request-id"])
    (completed,) = of(events, ev.RequestCompleted)
    assert len(completed.finish_reasons) == 4 and fold(events).outcome is not None  # type: ignore[attr-defined]
    logged: dict[int, str] = {}
    for batch in of(events, ev.DeltasDelivered):
        offset = 0
        for choice, chars, _ in batch.deltas:  # type: ignore[attr-defined]
            logged[choice] = logged.get(choice, "") + batch.text[offset : offset + chars]  # type: ignore[attr-defined]
            offset += chars
    assert logged == dict(enumerate(expected))  # the log holds what each choice was sent


def test_a_batch_of_token_id_prompts_is_answered_as_one_of_strings(gateway: RunningGateway) -> None:
    client = gateway.openai()
    batch = client.completions.create(model=MODEL, prompt=[[5, 9], [14]], max_tokens=4, temperature=0)
    alone = client.completions.create(model=MODEL, prompt=[14], max_tokens=4, temperature=0)
    assert [choice.index for choice in batch.choices] == [0, 1]
    assert batch.choices[1].text == alone.choices[0].text  # prompt 1 answers as it does alone
