"""vLLM's extra sampling parameters through the gateway, with the real ``openai`` client
(``extra_body``, as ``vllm serve`` users send them): validated, and passed on to sim
workers and to OpenAI-compatible replicas under the names the installed vLLM reads."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import openai
import pytest

from app.config import ReplicaConfig
from statemachine import events as ev
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.scripted_upstream import ScriptedUpstream, running_scripted_upstream
from tests.support.transcript import of

EXTRAS = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.15, "min_tokens": 40}


def test_extras_reach_the_sim_workers_and_shape_the_answer(
    gateway: RunningGateway, unique_prompt: Callable[[str], str]
) -> None:
    client = gateway.openai()
    prompt = [{"role": "user", "content": unique_prompt("long")}]
    answer = client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=60, extra_body=EXTRAS)
    assert answer.usage is not None and answer.usage.completion_tokens >= 40  # min_tokens held the end off
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": unique_prompt("pick")}],
        stream=True,
        extra_body={"guided_choice": ["alpha", "beta"]},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text in ("alpha", "beta")
    (accepted,) = of(gateway.events(stream.response.headers["x-request-id"]), ev.RequestAccepted)
    assert accepted.guided  # type: ignore[attr-defined]
    completion = client.completions.create(
        model=MODEL, prompt=unique_prompt("choose"), extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert completion.choices[0].text in ("yes", "no")


def test_bad_extras_are_a_400_naming_the_param_and_reach_no_replica(gateway: RunningGateway) -> None:
    client = gateway.openai()
    for extra_body, param in (
        ({"top_k": -7}, "top_k"),
        ({"min_tokens": 50}, "min_tokens"),  # over max_tokens
        ({"guided_regex": "(["}, "guided_regex"),
        ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10, extra_body=extra_body
            )
        body = caught.value.body
        assert isinstance(body, dict) and body["param"] == param and body["code"] == "invalid_request"
        assert caught.value.response.headers["x-should-retry"] == "false"
        assert gateway.events(caught.value.response.headers["x-request-id"]) == []  # nothing was accepted


@pytest.fixture
def upstream() -> Iterator[ScriptedUpstream]:
    with running_scripted_upstream() as running:
        yield running


def test_extras_are_passed_on_to_an_openai_compatible_replica(database_url: str, upstream: ScriptedUpstream) -> None:
    replicas = [ReplicaConfig(id="vllm-serve", url=upstream.base_url, kind="openai")]
    with running_gateway(database_url, replicas) as gateway:
        gateway.openai().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=50,
            extra_body={**EXTRAS, "guided_json": {"type": "object"}},
        )
        received = upstream.last_body
    assert received is not None
    assert {name: received[name] for name in EXTRAS} == EXTRAS
    # vLLM 0.32 ignores guided_json without a word: it gets the constraint as structured_outputs
    assert received["structured_outputs"] == {"json": {"type": "object"}} and "guided_json" not in received
