"""Real client frameworks against ``vllm serve`` directly and through phasegate (docs/design.md §14).

Each test runs the same framework call on ``vllm serve`` and through phasegate, in front of it
and in front of the vLLM worker (tests/compat/conftest.py: the hermes and deepseek_r1
parsers on both, the tiny model), and compares what the framework gives its caller. The
tiny model writes the same words whatever it is asked, so a tool call it is forced into
never closes its arguments: where that shows a difference between vLLM's whole and
streamed answers, the test says so.
instructor's releases pin ``jiter<0.15``, which the ``openai`` client this project tests
with (it needs ``jiter>=0.16``) cannot be installed beside: its calls run in a venv of their
own (tests/compat/instructor_call.py).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Callable
from typing import Any, Literal

import pytest
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI
from pydantic import BaseModel
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai import NativeOutput
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from tests.compat.conftest import Pair
from tests.support.vllm_replicas import MODEL
from tests.support.workers import REPO, instructor_python

pytestmark = pytest.mark.vllm
set_tracing_disabled(True)  # the Agents SDK would export its traces to OpenAI


class Unit(BaseModel):
    u: Literal["c", "f"]


def get_weather(unit: Literal["c", "f"]) -> str:
    """The weather where the user is."""
    return f"sunny, 21 {unit}"


def on_both(pair: Pair, call: Callable[[str], Any]) -> tuple[Any, Any]:
    """``call(base_url)`` against vllm serve, then through phasegate."""
    return call(pair.direct_url + "/v1"), call(pair.gateway_url + "/v1")


def chat_model(base_url: str, max_tokens: int = 12) -> ChatOpenAI:
    return ChatOpenAI(base_url=base_url, api_key="unused", model=MODEL, temperature=0, max_tokens=max_tokens)


def test_langchain_invoke(target: Pair) -> None:
    def invoke(url: str) -> tuple[Any, ...]:
        message = chat_model(url).invoke("hi")
        return message.content, message.additional_kwargs, message.response_metadata.get("finish_reason")

    direct, through = on_both(target, invoke)
    assert direct == through and direct[0]


def test_langchain_stream(target: Pair) -> None:
    direct, through = on_both(target, lambda url: [chunk.content for chunk in chat_model(url).stream("hi")])
    assert "".join(direct) == "".join(through) and "".join(direct)


def test_langchain_bind_tools_with_a_named_tool_streamed(target: Pair) -> None:
    def calls(url: str) -> list[tuple[Any, Any]]:
        bound = chat_model(url, max_tokens=40).bind_tools([get_weather], tool_choice="get_weather")
        whole = None
        for chunk in bound.stream("what is the weather?"):
            whole = chunk if whole is None else whole + chunk
        assert whole is not None
        return [(c["name"], c["args"]) for c in whole.tool_call_chunks]  # type: ignore[attr-defined]

    direct, through = on_both(target, calls)
    # the call is cut by max_tokens before any argument: vLLM streamed none (None), and
    # phasegate passes its pieces on as they came; or '{}', on either side, when the engine
    # handed vLLM's parser the last tokens with the finish (its named-call parser then
    # closes the arguments it never streamed: under load, seen through the worker and from
    # vllm serve itself)
    assert [name for name, _ in direct] == [name for name, _ in through] == ["get_weather"]
    assert direct[0][1] in (None, "{}") and through[0][1] in (None, "{}")


def test_langchain_structured_output_by_json_schema(target: Pair) -> None:
    direct, through = on_both(
        target, lambda url: chat_model(url, 60).with_structured_output(Unit, method="json_schema").invoke("unit?")
    )
    assert isinstance(direct, Unit) and direct == through


def test_langchain_structured_output_by_function_calling_is_served(target: Pair) -> None:
    """It sends ``parallel_tool_calls: false`` and a named ``tool_choice``: phasegate once
    refused the first. The tiny model's call is cut by ``max_tokens``: vLLM's whole answer
    gives it as text, phasegate's (built from the stream) as a tool call whose arguments do
    not parse (docs/compatibility.md, *tools, tool_choice named*); neither gives a Unit."""

    def structured(url: str) -> dict[str, Any]:
        runnable = chat_model(url, 40).with_structured_output(Unit, method="function_calling", include_raw=True)
        return runnable.invoke("unit?")  # type: ignore[return-value]

    direct, through = on_both(target, structured)
    assert direct["parsed"] is None and through["parsed"] is None
    assert direct["raw"].response_metadata["finish_reason"] == through["raw"].response_metadata["finish_reason"]
    assert direct["raw"].content.startswith('<tool_call>{"name": "Unit"')
    raw = through["raw"]
    assert [call["name"] for call in [*raw.tool_calls, *raw.invalid_tool_calls]] == ["Unit"]


def test_the_openai_agents_sdk_with_a_function_tool(target: Pair) -> None:
    async def run(url: str) -> Any:
        async with AsyncOpenAI(base_url=url, api_key="unused") as client:
            model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
            agent = Agent(name="a", instructions="be brief", tools=[function_tool(get_weather)], model=model)
            agent.model_settings = ModelSettings(temperature=0, max_tokens=12)
            return (await Runner.run(agent, "hi", max_turns=2)).final_output

    direct, through = on_both(target, lambda url: asyncio.run(run(url)))
    assert direct == through and direct


def test_pydantic_ai_structured_output(target: Pair) -> None:
    async def run(url: str) -> Any:
        async with AsyncOpenAI(base_url=url, api_key="unused") as client:
            model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client))
            settings: Any = {"temperature": 0, "max_tokens": 60}
            agent = PydanticAgent(model, output_type=NativeOutput(Unit), model_settings=settings)
            return (await agent.run("unit?")).output

    direct, through = on_both(target, lambda url: asyncio.run(run(url)))
    assert isinstance(direct, Unit) and direct == through


def test_instructor_structured_output_whole_and_streamed(target: Pair) -> None:
    """instructor's JSON-schema mode (``response_format``), whole and by ``create_partial``.
    Its tool mode is left out for the reason the tests above give: the tiny model's forced
    call is cut before its arguments close, so neither side gives a Unit."""

    def run(url: str) -> Any:
        script = str(REPO / "tests" / "compat" / "instructor_call.py")
        done = subprocess.run(
            [instructor_python(), script, url, MODEL], capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)

    direct, through = on_both(target, run)
    # the partial objects in between follow how the engine grouped the tokens into chunks,
    # which moves between runs (under load, and through a worker): the objects must agree
    assert direct["create"] == through["create"] and direct["create"]["u"] in ("c", "f")
    assert direct["partials"][-1] == through["partials"][-1] == direct["create"]
