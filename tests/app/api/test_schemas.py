"""Request validation: every bad input is a 400 naming its parameter, with a stable code."""

from __future__ import annotations

from typing import Any

import pytest

from app.api.chat.request import parse_request
from app.api.errors import InvalidRequest, UnsupportedParameter
from app.config import Limits
from app.contract.request_fields import OWN
from app.driver.request import CHAT, COMPLETIONS

LIMITS = Limits(max_tokens=1000, default_max_tokens=64)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_a_minimal_chat_request_sends_on_only_what_it_gave() -> None:
    """No sampling field is filled in: the replica's defaults apply (the model's generation
    config, the rest of the context), as they do against vLLM; the operator's configured
    default max_tokens is the one exception, and only when set."""
    request = parse_request(CHAT, chat(), Limits())
    assert (request.model, request.stream, request.include_usage, request.max_tokens, request.n) == (
        "m",
        False,
        False,
        None,
        1,
    )
    assert request.sampling() == {"n": 1}
    assert request.passed_on() == {"messages": [{"role": "user", "content": "hi"}]}
    assert request.prompt_text == "hi" and request.estimated_prompt_tokens == 1
    assert not request.guided
    defaulted = parse_request(CHAT, chat(), LIMITS)
    assert defaulted.sampling() == {"n": 1, "max_tokens": 64}
    assert defaulted.passed_on() == {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}
    asked = parse_request(CHAT, chat(max_completion_tokens=9), LIMITS)
    assert asked.passed_on() == {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}


def test_every_field_but_phasegates_own_is_passed_on_as_the_client_sent_it() -> None:
    given = {
        "logit_bias": {"20": -100},
        "parallel_tool_calls": False,
        "reasoning_effort": "low",
        "chat_template_kwargs": {"enable_thinking": False},
        "stop_token_ids": [2],
        "an_extension_vllm_does_not_declare": {"x": [1]},  # vLLM ignores it: passed on unread
    }
    request = parse_request(CHAT, chat(stream=True, stream_options={"include_usage": False}, **given), LIMITS)
    passed = request.passed_on()
    assert {name: passed[name] for name in given} == given
    assert not {"model", "stream", "stream_options"} & set(passed)  # phasegate sets these itself
    recorded = parse_request(CHAT, chat(metadata={"team": "a"}, store=False, service_tier="auto"), LIMITS)
    assert recorded.metadata == {"team": "a"} and not {"metadata", "store", "service_tier"} & set(recorded.passed_on())


@pytest.mark.parametrize("name", sorted(OWN))
def test_phasegates_own_fields_are_refused_saying_why(name: str) -> None:
    with pytest.raises(UnsupportedParameter, match=f"'{name}' is set by phasegate, not by a client: ") as caught:
        parse_request(CHAT, chat(**{name: "x"}), LIMITS)
    assert (caught.value.param, caught.value.code) == (name, "unsupported_parameter")


@pytest.mark.parametrize(
    ("prompt", "prompts", "tokens"),
    [
        (["a b", "c"], 2, 2),  # estimated: "a b\\nc", five characters
        ([5, 6, 7], 1, 3),
        ([[5, 6], [7, 8, 9]], 2, 5),
    ],
    ids=["strings", "token ids", "a batch of token ids"],
)
def test_completions_take_vllms_prompt_forms(prompt: list[Any], prompts: int, tokens: int) -> None:
    request = parse_request(COMPLETIONS, {"model": "m", "prompt": prompt, "n": 2}, LIMITS)
    assert (request.prompts, request.choices, request.passed_on()["prompt"]) == (prompts, 2 * prompts, prompt)
    assert request.estimated_prompt_tokens == tokens  # exact for token ids: the cost guard and the log use it


def test_a_completions_affinity_key_is_its_prompts_start_as_text_or_token_ids() -> None:
    def key(prompt: Any) -> str:
        return parse_request(COMPLETIONS, {"model": "m", "prompt": prompt}, LIMITS).affinity_key()

    long_ids = list(range(200))
    assert key(long_ids) == key([*long_ids, 7, 8])  # a follow-up that repeats the start: the same replica
    assert key([1, 2, 3]) != key([4, 5, 6]) != key("hello")  # token-id prompts no longer share one key
    assert key([[1, 2, 3], [9]]) == key([1, 2, 3]) and key(["hello", "x"]) == key("hello")  # a batch: its first


def test_completions_take_prompt_embeds_instead_of_a_prompt_and_pass_them_on() -> None:
    request = parse_request(COMPLETIONS, {"model": "m", "prompt_embeds": ["AAAA", "BBBB"]}, LIMITS)
    assert request.prompts == 2 and request.passed_on()["prompt_embeds"] == ["AAAA", "BBBB"]


def test_the_answers_role_follows_add_generation_prompt_as_vllm_gives_it() -> None:
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    assert parse_request(CHAT, chat(messages=turns), LIMITS).response_role == "assistant"
    continued = parse_request(CHAT, chat(messages=turns, add_generation_prompt=False), LIMITS)
    assert continued.response_role == "assistant"  # the role of the message it continues
    asked = parse_request(CHAT, chat(add_generation_prompt=False), LIMITS)
    assert asked.response_role == "user"


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
        # a list or an object as the role was once a 500 (unhashable)
        (CHAT, chat(messages=[{"role": ["user"], "content": "x"}]), "messages[0].role", "invalid_request", "role"),
        (CHAT, chat(messages=[{"role": {"a": 1}, "content": "x"}]), "messages[0].role", "invalid_request", "role"),
        (CHAT, chat(messages=[{"role": "user"}]), "messages[0].content", "invalid_request", "is required"),
        (CHAT, chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "invalid_request", "text parts"),
        (CHAT, chat(stream="yes"), "stream", "invalid_request", "must be a boolean"),
        (CHAT, chat(stream_options={"include_usage": True}), "stream_options", "invalid_request", "only allowed"),
        (CHAT, chat(stream=True, stream_options="yes"), "stream_options", "invalid_request", "must be an object"),
        (
            CHAT,
            chat(stream=True, stream_options={"continuous_usage_stats": 1}),
            "stream_options.continuous_usage_stats",
            "invalid_request",
            "must be a boolean",
        ),
        (CHAT, chat(max_tokens=0), "max_tokens", "invalid_request", "between 1 and 1000"),
        (CHAT, chat(max_tokens=1001), "max_tokens", "invalid_request", "between 1 and 1000"),
        (CHAT, chat(max_tokens=True), "max_tokens", "invalid_request", "must be an integer"),
        (CHAT, chat(max_tokens=2.5), "max_tokens", "invalid_request", "must be an integer"),
        (CHAT, chat(max_completion_tokens=-1), "max_completion_tokens", "invalid_request", "between"),
        (CHAT, chat(temperature=-0.5), "temperature", "invalid_request", "at least 0.0"),
        (CHAT, chat(temperature="hot"), "temperature", "invalid_request", "must be a number"),
        (CHAT, chat(top_p=0), "top_p", "invalid_request", r"in \(0.0, 1.0\]"),
        (CHAT, chat(n=0), "n", "invalid_request", "between 1 and 128"),
        (CHAT, chat(n=129), "n", "invalid_request", "between 1 and 128"),
        (CHAT, chat(stop=["a", 1]), "stop", "invalid_request", "a string or an array of them"),
        (CHAT, chat(seed="1"), "seed", "invalid_request", "must be an integer"),
        (CHAT, chat(seed=2**63), "seed", "invalid_request", "64-bit signed integer"),
        (CHAT, chat(seed=-(2**63) - 1), "seed", "invalid_request", "64-bit signed integer"),
        (CHAT, chat(presence_penalty=-3), "presence_penalty", "invalid_request", "in"),
        (CHAT, chat(tools=[{"type": "function"}]), "tools[0].function", "invalid_request", "is required"),
        (CHAT, chat(tool_choice="sometimes"), "tool_choice", "invalid_request", "named function"),
        (CHAT, chat(response_format={"type": "yaml"}), "response_format.type", "invalid_request", "json_schema"),
        (CHAT, chat(logit_bias={"1": "x"}), "logit_bias", "invalid_request", "object of numbers"),
        (CHAT, chat(parallel_tool_calls="no"), "parallel_tool_calls", "invalid_request", "must be a boolean"),
        (CHAT, chat(stop_token_ids=[1, "2"]), "stop_token_ids", "invalid_request", "array of token ids"),
        (CHAT, chat(metadata={"k": 1}), "metadata", "invalid_request", "object of at most 16 strings"),
        (CHAT, chat(request_id="mine"), "request_id", "unsupported_parameter", "set by phasegate"),
        (CHAT, chat(prompt_logprobs=-2), "prompt_logprobs", "invalid_request", "positive value or -1"),
        (CHAT, chat(prompt_logprobs=1.0), "prompt_logprobs", "invalid_request", "positive value or -1"),
        (CHAT, chat(stream=True, prompt_logprobs=1), "prompt_logprobs", "invalid_request", "'stream' is true"),
        (
            COMPLETIONS,
            {"model": "m", "prompt": "p", "stream": True, "prompt_logprobs": -1},
            "prompt_logprobs",
            "invalid_request",
            "'stream' is true",
        ),
        (COMPLETIONS, {"model": "m"}, "prompt", "invalid_request", "'prompt' is required"),
        (COMPLETIONS, {"model": "m", "prompt": ["a", 2]}, "prompt", "invalid_request", "'prompt' must be a non-empty"),
        (COMPLETIONS, {"model": "m", "prompt": [[1], []]}, "prompt", "invalid_request", "'prompt' must be a non-empty"),
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
        # what a worker or engine refused (or failed on) after the gateway admitted it, once
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
        # an OpenAI-compatible replica (vLLM 0.32 ignores the old names) gets what they mean
        assert request.passed_on()["structured_outputs"] == expected
        assert not any(name.startswith("guided_") for name in request.passed_on())


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
