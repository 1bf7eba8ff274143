"""app/worker/vllm_parsing.py over vLLM's real parsers (``deepseek_r1``, ``hermes``) and the
tiny model's tokenizer, without an engine: an answer of two tool calls, token by token, is
two calls streamed in pieces and taken whole, the choice finishing as ``tool_calls``; with
``parallel_tool_calls: false``, only the first, as vLLM's server filters them
(``maybe_filter_parallel_tool_calls``). The tiny model never makes two calls, so the
engine's text is written here, as a model that makes two would generate it.

vLLM lives in its own environment (.ci/vllm-env): the checks run there, in a child process.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.workers import run_in_vllm, vllm_env

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_subprocess]  # not on the shared vLLM: a unit of its own

CHECKS = """
import json, sys
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tokenizers import get_tokenizer
from app.worker.protocol import AttemptSpec, Sampling
from app.worker.vllm_parsing import ParserNames, Parsers

tokenizer = get_tokenizer(sys.argv[1])
parsers = Parsers(ParserNames("deepseek_r1", "hermes", True), tokenizer, "m")
tools = ({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},)
call = '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>'
ids = tokenizer.encode("</think>" + call % "Paris" + call % "Rome", add_special_tokens=False)
found = {}
for parallel in (None, False):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": list(tools), "tool_choice": "auto"}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    sampling = Sampling(tools=tools, tool_choice="auto")
    spec = AttemptSpec("r", 1, 1, 5.0, "m", tuple(body["messages"]), None, sampling, 0.25, fields=body)
    parsing = parsers.for_attempt(spec)
    parsing.adjust(ChatCompletionRequest.model_validate(body))
    parsing.engine_kwargs(tokenizer.encode("hi"))
    outputs = []
    for n, token in enumerate(ids):
        finish = "stop" if n == len(ids) - 1 else None
        outputs += parsing.outputs(0, [token], tokenizer.decode([token]), finish, None)
    found[str(parallel)] = {
        "pieces": [json.loads(o.text) for o in outputs if o.key == "tool_calls"],
        "calls": [[o.tool_call.index, o.tool_call.arguments] for o in outputs if o.tool_call is not None],
        "finish": [o.finish_reason for o in outputs if o.finish_reason is not None],
        "tokens": sum(len(o.token_ids) for o in outputs),
    }
print(json.dumps({"found": found, "tokens": len(ids)}))
"""


@pytest.fixture(scope="module")
def found() -> dict[str, Any]:
    return run_in_vllm(CHECKS, vllm_env().model)  # type: ignore[no-any-return]


def test_two_calls_are_two_calls_streamed_and_taken(found: dict[str, Any]) -> None:
    got = found["found"]["None"]
    assert {piece["index"] for pieces in got["pieces"] for piece in pieces} == {0, 1}
    assert [index for index, _ in got["calls"]] == [0, 1]
    assert [json.loads(arguments)["city"] for _, arguments in got["calls"]] == ["Paris", "Rome"]
    assert got["finish"] == ["tool_calls"] and got["tokens"] == found["tokens"]  # every token counted once


def test_parallel_tool_calls_false_keeps_the_first_call_only(found: dict[str, Any]) -> None:
    got = found["found"]["False"]
    assert {piece["index"] for pieces in got["pieces"] for piece in pieces} == {0}
    assert [json.loads(arguments)["city"] for _, arguments in got["calls"]] == ["Paris"]
    assert got["finish"] == ["tool_calls"] and got["tokens"] == found["tokens"]
