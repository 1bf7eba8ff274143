"""The OpenAI Agents SDK's default model, the Responses API one, runs an agent through
phasegate over real sim workers (docs/design.md §15): the model calls the function tool (a sim
worker given tools calls the first), the SDK parses the call from the response, runs the
tool and ends with its output. Judged by what the agent returned and by the log."""

from __future__ import annotations

import asyncio
from typing import Any

from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from statemachine import events as ev
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.support.gateway import MODEL, RunningGateway
from tests.support.transcript import of

set_tracing_disabled(True)  # the Agents SDK would export its traces to OpenAI
ran: list[str] = []


def lookup(word: str) -> str:
    """What a word means."""
    ran.append(word)
    return f"{word}: lasting a very short time"


def test_an_agent_on_the_responses_api_calls_its_tool_and_ends_with_its_output(gateway: RunningGateway) -> None:
    async def run() -> Any:
        async with AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as client:
            model = OpenAIResponsesModel(model=MODEL, openai_client=client)
            agent = Agent(
                name="a",
                instructions="be brief",
                tools=[function_tool(lookup)],
                model=model,
                model_settings=ModelSettings(max_tokens=8),
                # a sim worker given tools calls one whenever it may, so the loop ends on the
                # tool's output (a call's output handed back is test_responses.py's)
                tool_use_behavior="stop_on_first_tool",
            )
            return await Runner.run(agent, "what does ephemeral mean", max_turns=3)

    ran.clear()
    result = asyncio.run(run())
    assert len(ran) == 1 and result.final_output == f"{ran[0]}: lasting a very short time"
    (response_id,) = [r.response_id for r in result.raw_responses]
    assert response_id is not None and response_id.startswith("resp_")
    events = gateway.events("req_" + response_id.removeprefix("resp_"))
    accepted = events[0]
    assert isinstance(accepted, ev.RequestAccepted) and accepted.endpoint == "responses"
    assert [e.name for e in of(events, ev.ToolCallEmitted)] == ["lookup"]  # type: ignore[attr-defined]
    assert fold(events).outcome is Outcome.COMPLETED
