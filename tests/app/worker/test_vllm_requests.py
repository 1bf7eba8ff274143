"""app/worker/vllm_requests.py over vLLM's real renderer and the tiny model, without an engine:
a chat is rendered with the worker's ``--chat-template`` when it has one, ``/tokenize``
renders as an attempt does, and what vLLM's checks refuse is refused in vLLM's words with
the code a client gets through an ``openai`` replica.

vLLM lives in its own environment (.ci/vllm-env), so the checks run there, in one child
process that prints what it found (about 10 s: vLLM's imports and the model's config).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.workers import run_in_vllm, vllm_env

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_subprocess]  # not on the shared vLLM: a unit of its own

TEMPLATE = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}|{% endfor %}"

CHECKS = """
import json, sys
from types import SimpleNamespace

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest, TokenizeCompletionRequest
from vllm.renderers.registry import renderer_from_config
from vllm.v1.engine.input_processor import InputProcessor

from app.worker.protocol import AttemptSpec, Refusal, Sampling
from app.worker.vllm_requests import VllmRequests, token_ids

model, template = sys.argv[1], sys.argv[2]
config = AsyncEngineArgs(model=model, max_model_len=4096, enforce_eager=True).create_engine_config()
renderer = renderer_from_config(config)
llm = SimpleNamespace(
    renderer=renderer, model_config=config.model_config, input_processor=InputProcessor(config, renderer)
)
custom, default = VllmRequests(llm, template), VllmRequests(llm)
hi = [{"role": "user", "content": "hi"}]


def tokens(requests, body):
    if "messages" in body:
        return token_ids(requests.render_chat(TokenizeChatRequest.model_validate(body))[1])
    request = TokenizeCompletionRequest.model_validate(body)
    return token_ids(requests.render_prompt(request, request.prompt))


def attempt(requests, messages, prompt=None, **fields):
    spec = AttemptSpec("r", 1, 1, 5.0, "m", messages and tuple(messages), prompt, Sampling(), 0.25, fields=fields)
    try:
        read = requests.read(spec)
        params = requests.sampling_params(read)
        return {"prompt_token_ids": read.prompt_token_ids, "max_tokens": params.max_tokens,
                "echo": read.echo, "said": read.prompt_said(), "beam_width": getattr(params, "beam_width", None)}
    except Refusal as refusal:
        return {"status": refusal.status, "code": refusal.code.value, "message": refusal.message,
                "field": refusal.field}


print(json.dumps({
    "custom chat": tokens(custom, {"messages": hi}),
    "its text": tokens(custom, {"prompt": "user:hi|", "add_special_tokens": False}),
    "default chat": tokens(default, {"messages": hi}),
    "attempt, custom": attempt(custom, hi),
    "attempt, default": attempt(default, hi),
    "max_tokens over the context": attempt(default, hi, max_tokens=100_000),
    "echo": attempt(default, hi, echo=True),
    "echo, continued": attempt(default, [*hi, {"role": "assistant", "content": "Hel"}], echo=True,
                               add_generation_prompt=False, continue_final_message=True),
    "echo, not asked": attempt(default, [*hi, {"role": "assistant", "content": "Hel"}],
                               add_generation_prompt=False, continue_final_message=True),
    "completions echo": attempt(default, None, "hi", echo=True),
    "completions echo, logprobs": attempt(default, None, "hi", echo=True, logprobs=1),
    "beam search": attempt(default, hi, use_beam_search=True, n=2),
    "completions echo, token ids": attempt(default, None, "hi", echo=True, return_token_ids=True),
    "return_prompt_text": attempt(default, hi, return_prompt_text=True),
    "thinking_token_budget, no reasoning": attempt(default, hi, thinking_token_budget=2),
}))
"""


@pytest.fixture(scope="module")
def found() -> dict[str, Any]:
    return run_in_vllm(CHECKS, vllm_env().model, TEMPLATE)  # type: ignore[no-any-return]


def test_the_workers_chat_template_renders_the_prompt(found: dict[str, Any]) -> None:
    assert found["custom chat"] == found["its text"] != found["default chat"]
    assert found["attempt, custom"]["prompt_token_ids"] == found["custom chat"]


def test_an_attempt_and_tokenize_render_the_same_prompt(found: dict[str, Any]) -> None:
    """``/tokenize``'s count is the prompt tokens an attempt of the same messages has; with
    no max_tokens asked, the rest of the context, as vLLM's server gives it."""
    attempt = found["attempt, default"]
    assert attempt["prompt_token_ids"] == found["default chat"]
    assert attempt["max_tokens"] == 4096 - len(found["default chat"])


def test_vllms_refusals_are_vllms_words_with_the_clients_code(found: dict[str, Any]) -> None:
    over = found["max_tokens over the context"]
    assert (over["status"], over["code"], over["field"]) == (400, "upstream_bad_request", "max_tokens")
    assert over["message"] == (  # as vllm serve words it (tests/compat/test_differential.py compares them)
        "max_tokens=100000 cannot be greater than max_model_len=4096. Please request fewer output tokens."
        " (parameter=max_tokens, value=100000)"
    )


def test_the_engines_own_checks_refuse_before_the_stream(found: dict[str, Any]) -> None:
    """What vLLM's engine refuses as its stream begins (``thinking_token_budget`` with no
    reasoning configuration: this engine has none) is the client's 400 in vLLM's words,
    before the attempt's stream starts, never an engine failure (docs/design.md §13)."""
    refused = found["thinking_token_budget, no reasoning"]
    assert (refused["status"], refused["code"], refused["field"]) == (400, "upstream_bad_request", None)
    assert refused["message"].startswith("thinking_token_budget is set but reasoning_config is not configured")


def test_a_beam_search_gets_vllms_beam_search_parameters(found: dict[str, Any]) -> None:
    """``use_beam_search`` is served (app/worker/vllm_beams.py): its parameters as vLLM's
    server makes them, ``n`` beams and the rest of the context."""
    beams = found["beam search"]
    assert (beams["beam_width"], beams["max_tokens"]) == (2, 4096 - len(found["default chat"]))


def test_what_vllms_server_says_of_the_prompt_is_said_where_asked(found: dict[str, Any]) -> None:
    """A completion's echo is its prompt's text before the answer, with the prompt's token
    ids (vLLM's echo stream names them unasked); with ``return_token_ids`` the echo is no
    text, the ids say it. ``return_prompt_text`` gives the rendered chat prompt; nothing
    asked, nothing said."""
    echo, ids = found["completions echo"], found["completions echo, token ids"]
    assert (echo["echo"], echo["said"]) == ("hi", [echo["prompt_token_ids"], None])
    assert found["completions echo, logprobs"]["echo"] == "hi"  # the prompt's log probabilities come with it
    assert (ids["echo"], ids["said"]) == ("", [ids["prompt_token_ids"], None])
    prompt_ids, text = found["return_prompt_text"]["said"]
    assert prompt_ids is None and text.endswith("hi<|end|><|assistant|><think>")
    assert found["attempt, default"]["said"] is None


def test_a_chat_echo_is_the_last_message_when_it_is_the_answers_role(found: dict[str, Any]) -> None:
    """As vLLM's server echoes: the continued assistant message, and nothing after a user's."""
    assert (found["echo, continued"]["echo"], found["echo"]["echo"], found["echo, not asked"]["echo"]) == (
        "Hel",
        "",
        "",
    )
