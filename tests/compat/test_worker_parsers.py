"""vLLM's own output parsers in ``phasegate worker --engine vllm`` (app/worker/vllm_parsing.py):
the same request to ``vllm serve`` and through phasegate in front of the run's vLLM worker,
which runs the same model with the same parsers (``deepseek_r1``, ``hermes``, auto tool
choice: tests/support/vllm_replicas.py), gets the same reasoning, content and tool calls,
whole and streamed (docs/design.md §14).

The tiny model never closes a ``<think>``, so under the ``deepseek_r1`` parser its whole
answer is reasoning; a ``required`` or named ``tool_choice`` forces a call through the
structured output vLLM's tool parser asks for. Compared as a client reads them
(tests/compat/compare.py).
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.compat.compare import differences
from tests.compat.conftest import Pair
from tests.compat.test_differential import CASES, DIVERGENCES, TOOLS
from tests.support.vllm_replicas import MODEL

pytestmark = pytest.mark.vllm

NAMED = {"type": "function", "function": {"name": "get_weather"}}
PARSED = ["chat", "tools, tool_choice none", "tools, tool_choice auto", "tools, tool_choice named"]
PARSED += ["tools, tool_choice required"]


def parsed_cases() -> list[Any]:
    """Each case whole and streamed; phasegate's divergences from ``vllm serve`` are the
    ``openai`` path's (tests/compat/test_differential.py), for the same reason: phasegate
    builds a whole answer from the worker's stream, and vLLM's whole answer parses a tool
    call cut by ``max_tokens`` as text where its stream gives the call."""
    cases = []
    for case in PARSED:
        for mode in ("whole", "stream"):
            why = DIVERGENCES.get((case, mode)) or DIVERGENCES.get((case, "both"))
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            cases.append(pytest.param(case, mode, id=f"{case} [{mode}]", marks=marks))
    return cases


@pytest.mark.parametrize(("case", "mode"), parsed_cases())
def test_the_worker_parses_reasoning_and_tool_calls_as_vllm_serve(worker_pair: Pair, case: str, mode: str) -> None:
    path, body = CASES[case]
    direct, through = worker_pair.both(path, {**body, "stream": mode == "stream"})
    assert direct.status == 200, direct.body
    found = differences(direct, through)
    assert found == [], "\n".join(found)


def test_a_forced_call_through_the_worker_is_a_tool_call_and_its_reasoning_is_reasoning(worker_pair: Pair) -> None:
    """With the ``openai`` client: a named tool is called, whole and streamed the same (the
    tiny model's arguments are whatever the structured output lets it say, cut by
    ``max_tokens``); the unforced answer's think block is the parser's reasoning."""
    with openai.OpenAI(base_url=worker_pair.gateway_url + "/v1", api_key="k", max_retries=0, timeout=120) as client:
        ask_for = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
        whole = client.chat.completions.create(**ask_for, tools=TOOLS, tool_choice=NAMED, max_tokens=200)  # type: ignore[call-overload]
        (call,) = whole.choices[0].message.tool_calls or []
        assert call.function.name == "get_weather" and call.function.arguments
        assert whole.choices[0].finish_reason in {"stop", "length"}  # named: the engine's reason, as vLLM says
        streamed = client.chat.completions.create(
            **ask_for, tools=TOOLS, tool_choice=NAMED, max_tokens=200, stream=True
        )  # type: ignore[call-overload]
        arguments = "".join(
            tc.function.arguments or ""
            for chunk in streamed
            for choice in chunk.choices
            for tc in choice.delta.tool_calls or ()
            if tc.function is not None
        )
        assert arguments == call.function.arguments
        plain = client.chat.completions.create(**ask_for, max_tokens=12)  # type: ignore[call-overload]
        message = plain.choices[0].message
        assert (message.model_extra or {}).get("reasoning") == " first client may retry,"
        assert message.content and "</think>" not in message.content
