"""Request validation: every bad input is a 400 naming its parameter, with a stable code."""

from __future__ import annotations

from typing import Any

import pytest

from app.api.errors import InvalidRequest, UnsupportedParameter
from app.api.schemas import parse_request
from app.config import Limits
from app.driver.request import CHAT, COMPLETIONS

LIMITS = Limits(max_tokens=1000, default_max_tokens=64)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_a_minimal_chat_request_gets_defaults() -> None:
    request = parse_request(CHAT, chat(), LIMITS)
    assert (request.model, request.stream, request.include_usage, request.max_tokens, request.n) == (
        "m",
        False,
        False,
        64,
        1,
    )
    assert request.sampling() == {
        "max_tokens": 64,
        "temperature": 1.0,
        "top_p": 1.0,
        "n": 1,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }
    assert request.prompt_text == "hi" and request.estimated_prompt_tokens == 1
    assert not request.guided


def test_a_full_chat_request_is_carried_through() -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    request = parse_request(
        CHAT,
        chat(
            stream=True,
            stream_options={"include_usage": True},
            max_completion_tokens=10,
            temperature=0,
            top_p=0.5,
            n=2,
            stop="END",
            seed=7,
            tools=tools,
            tool_choice="auto",
            response_format={"type": "json_object"},
            user="u1",
        ),
        LIMITS,
    )
    assert request.include_usage and request.max_tokens == 10 and request.guided
    sampling = request.sampling()
    assert sampling["stop"] == ["END"] and sampling["seed"] == 7 and sampling["tools"] == tools
    assert sampling["tool_choice"] == "auto" and sampling["response_format"] == {"type": "json_object"}
    assert request.params_digest().startswith("sha256:")
    assert request.params_digest() == parse_request(CHAT, request.raw, LIMITS).params_digest()


def test_completions_take_a_prompt_or_a_batch_of_one() -> None:
    assert parse_request(COMPLETIONS, {"model": "m", "prompt": "x"}, LIMITS).prompt == "x"
    assert parse_request(COMPLETIONS, {"model": "m", "prompt": ["y"]}, LIMITS).prompt_text == "y"


def test_text_parts_are_accepted_as_content() -> None:
    message = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert parse_request(CHAT, chat(messages=[message]), LIMITS).prompt_text == "ab"


@pytest.mark.parametrize(
    ("endpoint", "body", "param", "code", "message"),
    [
        (CHAT, [], None, "invalid_request", "must be a JSON object"),
        (CHAT, {"messages": []}, "model", "invalid_request", "'model' is required"),
        (CHAT, chat(model=""), "model", "invalid_request", "must not be empty"),
        (CHAT, chat(model=3), "model", "invalid_request", "'model' must be a string"),
        (CHAT, {"model": "m"}, "messages", "invalid_request", "'messages' is required"),
        (CHAT, chat(messages=[]), "messages", "invalid_request", "must not be empty"),
        (CHAT, chat(messages="hi"), "messages", "invalid_request", "must be an array"),
        (CHAT, chat(messages=["hi"]), "messages[0]", "invalid_request", "must be an object"),
        (CHAT, chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role", "invalid_request", "role"),
        # a list or an object as the role was a 500 (unhashable; issue 14)
        (CHAT, chat(messages=[{"role": ["user"], "content": "x"}]), "messages[0].role", "invalid_request", "role"),
        (CHAT, chat(messages=[{"role": {"a": 1}, "content": "x"}]), "messages[0].role", "invalid_request", "role"),
        (CHAT, chat(messages=[{"role": "user"}]), "messages[0].content", "invalid_request", "is required"),
        (CHAT, chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "invalid_request", "text parts"),
        (CHAT, chat(stream="yes"), "stream", "invalid_request", "must be a boolean"),
        (CHAT, chat(stream_options={"include_usage": True}), "stream_options", "invalid_request", "only allowed"),
        (CHAT, chat(stream=True, stream_options={"x": 1}), "stream_options", "invalid_request", "only 'include_usage'"),
        (CHAT, chat(max_tokens=0), "max_tokens", "invalid_request", "between 1 and 1000"),
        (CHAT, chat(max_tokens=1001), "max_tokens", "invalid_request", "between 1 and 1000"),
        (CHAT, chat(max_tokens=True), "max_tokens", "invalid_request", "must be an integer"),
        (CHAT, chat(max_tokens=2.5), "max_tokens", "invalid_request", "must be an integer"),
        (CHAT, chat(max_completion_tokens=-1), "max_completion_tokens", "invalid_request", "between"),
        (CHAT, chat(temperature=3), "temperature", "invalid_request", r"in \[0.0, 2.0\]"),
        (CHAT, chat(temperature="hot"), "temperature", "invalid_request", "must be a number"),
        (CHAT, chat(top_p=0), "top_p", "invalid_request", r"in \(0.0, 1.0\]"),
        (CHAT, chat(n=0), "n", "invalid_request", "between 1 and 8"),
        (CHAT, chat(n=9), "n", "invalid_request", "between 1 and 8"),
        (CHAT, chat(stop=["a", "b", "c", "d", "e"]), "stop", "invalid_request", "at most 4"),
        (CHAT, chat(stop=[""]), "stop", "invalid_request", "non-empty string"),
        (CHAT, chat(seed="1"), "seed", "invalid_request", "must be an integer"),
        (CHAT, chat(seed=2**63), "seed", "invalid_request", "64-bit signed integer"),
        (CHAT, chat(seed=-(2**63) - 1), "seed", "invalid_request", "64-bit signed integer"),
        (CHAT, chat(presence_penalty=-3), "presence_penalty", "invalid_request", "in"),
        (CHAT, chat(tools=[{"type": "function"}]), "tools[0].function", "invalid_request", "must be an object"),
        (CHAT, chat(tool_choice="sometimes"), "tool_choice", "invalid_request", "named function"),
        (CHAT, chat(response_format={"type": "yaml"}), "response_format.type", "invalid_request", "json_schema"),
        (CHAT, chat(logit_bias={}), "logit_bias", "unsupported_parameter", "does not support .logit_bias."),
        (CHAT, chat(frobnicate=1), "frobnicate", "unsupported_parameter", "unrecognized request argument"),
        (CHAT, chat(prompt="x"), "prompt", "unsupported_parameter", "unrecognized"),
        (COMPLETIONS, {"model": "m"}, "prompt", "invalid_request", "'prompt' is required"),
        (COMPLETIONS, {"model": "m", "prompt": ["a", "b"]}, "prompt", "unsupported_parameter", "batch"),
        (
            COMPLETIONS,
            {"model": "m", "prompt": "x", "messages": []},
            "messages",
            "unsupported_parameter",
            "unrecognized",
        ),
    ],
)
def test_bad_input_is_named(endpoint: str, body: Any, param: str | None, code: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as caught:
        parse_request(endpoint, body, LIMITS)
    error = caught.value
    assert (error.param, error.code, error.status) == (param, code, 400)
    body_json = error.body("req_x")["error"]
    assert body_json["type"] == "invalid_request_error" and body_json["request_id"] == "req_x"


def test_unsupported_is_a_kind_of_invalid() -> None:
    assert issubclass(UnsupportedParameter, InvalidRequest)


F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        # what a worker or engine refused (or failed on) after the gateway admitted it (issue 14)
        ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": []}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": "json_object"}, "response_format"),
        ({"response_format": {"type": ["text"]}}, "response_format.type"),
        ({"tools": [F], "tool_choice": {"type": "function", "function": {"name": ["f"]}}}, "tool_choice.function.name"),
        ({"tools": [F], "tool_choice": {"function": "f"}}, "tool_choice.function"),
        ({"tools": [F], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
        ({"tools": [F], "tool_choice": {"type": "retrieval", "function": {"name": "f"}}}, "tool_choice.type"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": ["a"]}}}]},
            "tools[0].function.parameters.properties",
        ),
        ({"tools": [1]}, "tools[0]"),
        ({"tools": {"f": F}}, "tools"),
        ({"tools": [F, F]}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "description": 5}}]},
            "tools[0].function.description",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": 5}]}, "messages[0].tool_calls"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": 1}}]}]},
            "messages[0].tool_calls[0].function.name",
        ),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 7}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "name": ["n"]}]}, "messages[0].name"),
    ],
)
def test_what_an_engine_reads_is_checked_to_its_depth(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_request(CHAT, chat(**fields), LIMITS)
    assert (caught.value.param, caught.value.code, caught.value.status) == (param, "invalid_request", 400)
    assert caught.value.message.startswith(f"'{param}' ")


def test_what_an_engine_reads_passes_when_well_formed() -> None:
    tools = [F, {"type": "function", "function": {"name": "g", "description": "d", "strict": True}}]
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}, "strict": True}}
    request = parse_request(
        CHAT,
        chat(
            messages=messages,
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "g"}},
            response_format=schema,
        ),
        LIMITS,
    )
    assert request.tools == tuple(tools) and request.response_format == schema
    assert request.tool_choice == {"type": "function", "function": {"name": "g"}}


def test_vllms_ignore_eos_is_validated_and_passed_on() -> None:
    request = parse_request(COMPLETIONS, {"model": "m", "prompt": "p", "ignore_eos": True}, LIMITS)
    assert request.ignore_eos and request.sampling()["ignore_eos"] is True
    assert "ignore_eos" not in parse_request(CHAT, chat(ignore_eos=False), LIMITS).sampling()
    with pytest.raises(InvalidRequest) as refused:
        parse_request(CHAT, chat(ignore_eos="yes"), LIMITS)
    assert refused.value.param == "ignore_eos"


# --- vLLM's extra sampling parameters and structured outputs (app/contract/vllm_extras.py) ---


def test_vllms_sampling_extras_are_validated_and_passed_on() -> None:
    extras = {"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 8}
    request = parse_request(CHAT, chat(max_tokens=20, **extras), LIMITS)
    assert {name: request.sampling()[name] for name in extras} == extras
    assert not request.guided
    plain = parse_request(COMPLETIONS, {"model": "m", "prompt": "p", "top_k": -1, "min_tokens": 0}, LIMITS)
    assert plain.sampling()["top_k"] == -1 and "min_tokens" not in plain.sampling()  # 0 is the default


@pytest.mark.parametrize(
    ("given", "passed_on"),
    [
        ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
        ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
        ({"guided_json": {"type": "object"}}, {"json": {"type": "object"}}),
        ({"guided_json": '{"type": "object"}'}, {"json": '{"type": "object"}'}),
        ({"guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
        ({"structured_outputs": {"choice": ["a"], "disable_any_whitespace": True}}, None),
        ({"structured_outputs": {"json_object": True}}, None),
    ],
)
def test_structured_outputs_old_and_new_names_pass_on_as_vllm_reads_them(
    given: dict[str, Any], passed_on: dict[str, Any] | None
) -> None:
    for endpoint, body in ((CHAT, chat(**given)), (COMPLETIONS, {"model": "m", "prompt": "p", **given})):
        request = parse_request(endpoint, body, LIMITS)
        expected = passed_on or given["structured_outputs"]
        assert request.sampling()["structured_outputs"] == expected and request.guided
        assert not any(name.startswith("guided_") for name in request.sampling())


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"top_k": -2}, "top_k", "-1 or 0"),
        ({"top_k": 1.5}, "top_k", "-1 or 0"),
        ({"top_k": True}, "top_k", "-1 or 0"),
        ({"min_p": 1.5}, "min_p", r"in \[0, 1\]"),
        ({"min_p": "low"}, "min_p", "must be a number"),
        ({"repetition_penalty": 0}, "repetition_penalty", r"in \(0, 100\]"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty", "must be a number"),
        ({"min_tokens": 11, "max_tokens": 10}, "min_tokens", r"from 0 to max_tokens \(10\)"),
        ({"min_tokens": -1}, "min_tokens", "from 0"),
        ({"guided_choice": []}, "guided_choice", "array of 1 to"),
        ({"guided_choice": ["a", 1]}, "guided_choice", "non-empty strings"),
        ({"guided_regex": "(unclosed"}, "guided_regex", "not a regular expression"),
        ({"guided_json": "[1]"}, "guided_json", "JSON schema"),
        ({"guided_json": "{nope"}, "guided_json", "JSON schema"),
        ({"guided_grammar": ""}, "guided_grammar", "non-empty string"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "give one constraint"),
        ({"guided_regex": "a", "structured_outputs": {"regex": "a"}}, "guided_regex", "structured_outputs"),
        ({"structured_outputs": "regex"}, "structured_outputs", "must be an object"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object", "must be true"),
        ({"structured_outputs": {"backend": "xgrammar"}}, "structured_outputs.backend", "is not one of"),
        (
            {"structured_outputs": {"regex": "a", "disable_any_whitespace": 1}},
            "structured_outputs.disable_any_whitespace",
            "boolean",
        ),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "response_format",
            "not both",
        ),
    ],
)
def test_bad_vllm_extras_are_named(fields: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as caught:
        parse_request(CHAT, chat(**fields), LIMITS)
    assert (caught.value.param, caught.value.code, caught.value.status) == (param, "invalid_request", 400)
