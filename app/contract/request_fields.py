"""The request fields of ``vllm serve`` 0.32 (its ``ChatCompletionRequest`` and
``CompletionRequest``), each in the class that says what phasegate does with it
(DESIGN.md §14; the table with the test that shows each: docs/compatibility.md).

- *passed on*: sent to the replica as the client sent it (an ``openai`` replica gets the
  client's JSON value; a worker applies it as vLLM's server does). phasegate reads some
  of them too (``n``, ``max_tokens``, ``logprobs``, ``tools``…), and checks those;
- *phasegate's own*: set by phasegate, never by the client, because they touch other
  tenants or the engine's identity (DESIGN.md §13): refused with a 400 that says why;
- *whole only*: passed-on fields vLLM serves only in a whole answer, refused (phasegate
  streams every upstream answer);
- *recorded*: fields vLLM accepts and ignores, kept in the log (``metadata``, which audit
  queries want) and not acted on;
- *set by phasegate for itself*: ``stream`` and ``stream_options.include_usage`` are sent
  as phasegate needs them (a streamed upstream gives liveness, fencing and the commit
  point; the usage goes to the log); what the client did not ask for is not shown to it.

A field in none of these vLLM does not declare: vLLM accepts it and does nothing (its
request models allow extra fields), so phasegate passes it on unread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

# sampling and output fields both endpoints declare
_COMMON = frozenset(
    {
        "model",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "max_tokens",
        "n",
        "presence_penalty",
        "response_format",
        "seed",
        "stop",
        "temperature",
        "top_p",
        "user",
        "use_beam_search",
        "top_k",
        "min_p",
        "repetition_penalty",
        "watermarking",
        "length_penalty",
        "stop_token_ids",
        "include_stop_str_in_output",
        "ignore_eos",
        "min_tokens",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "truncate_prompt_tokens",
        "truncation_side",
        "prompt_logprobs",
        "logprob_token_ids",
        "allowed_token_ids",
        "bad_words",
        "add_special_tokens",
        "structured_outputs",
        "session_id",
        "return_tokens_as_token_ids",
        "return_token_ids",
        "routed_experts_prompt_start",
        "return_token_offsets",
        "mm_payload",
        "return_mm_kwargs",
        "repetition_detection",
        "thinking_token_budget",
        "stream_interval",
        "echo",
    }
)
PASSED_CHAT = _COMMON | {
    "messages",
    "top_logprobs",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "reasoning_effort",
    "include_reasoning",
    "parallel_tool_calls",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "chat_template_kwargs",
    "media_io_kwargs",
    "return_prompt_text",
}
PASSED_COMPLETIONS = _COMMON | {"prompt", "suffix", "prompt_embeds"}

# phasegate's own, and why a client may not set them
OWN: dict[str, str] = {
    "request_id": "phasegate names each attempt's engine request itself (its x-request-id names the request)",
    "priority": "the scheduling priority is the operator's to give, not a tenant's to take",
    "cache_salt": "phasegate salts the prefix cache per tenant, so that tenants never share cached prefixes",
    "chat_template": "the chat template is the replica's configuration (--chat-template), one for every tenant",
    "kv_transfer_params": "KV-cache transfer is the deployment's, between its own replicas",
    "ec_transfer_params": "encoder-cache transfer is the deployment's, between its own replicas",
    "vllm_xargs": "extra engine arguments are the operator's configuration",
    "mm_processor_kwargs": "the multimodal processor's settings are the replica's configuration",
}

# passed-on fields vLLM serves only in a whole answer: phasegate streams every upstream
# answer, so it refuses them (a 400 saying why) rather than let vLLM refuse a stream
WHOLE_ONLY: dict[str, str] = {
    "prompt_logprobs": "vLLM gives prompt log probabilities only in an answer it does not stream, and phasegate"
    " streams every answer from its replicas (liveness, fencing, the commit point)",
}

# accepted and kept in the log; vLLM ignores them
RECORDED = frozenset({"metadata", "store", "service_tier"})

# sent by phasegate as it needs them, whatever the client asked (its answer follows what it asked)
SET_BY_PHASEGATE = frozenset({"stream", "stream_options"})


def passed_fields(chat: bool) -> frozenset[str]:
    """The fields of the endpoint that are passed on."""
    return PASSED_CHAT if chat else PASSED_COMPLETIONS


# --- the JSON type of each passed-on field phasegate does not read itself -----------------


def _bool(value: Any) -> bool:
    return isinstance(value, bool)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _str(value: Any) -> bool:
    return isinstance(value, str)


def _object(value: Any) -> bool:
    return isinstance(value, dict)


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(_int(item) for item in value)


def _strs(value: Any) -> bool:
    return isinstance(value, list) and all(_str(item) for item in value)


def _bias(value: Any) -> bool:
    return isinstance(value, dict) and all(_number(item) for item in value.values())


def _objects(value: Any) -> bool:
    return isinstance(value, list) and all(_object(item) for item in value)


class FieldType(NamedTuple):
    """A passed-on field's JSON type: how it is checked, said, and described (OpenAPI)."""

    check: Callable[[Any], bool]
    what: str
    schema: dict[str, Any]


BOOLEAN = FieldType(_bool, "a boolean", {"type": "boolean"})
INTEGER = FieldType(_int, "an integer", {"type": "integer"})
NUMBER = FieldType(_number, "a number", {"type": "number"})
STRING = FieldType(_str, "a string", {"type": "string"})
OBJECT = FieldType(_object, "an object", {"type": "object"})
TOKEN_IDS = FieldType(_ints, "an array of token ids", {"type": "array", "items": {"type": "integer"}})
FIELD_TYPES: dict[str, FieldType] = {
    "logit_bias": FieldType(_bias, "an object of numbers by token id", {"type": "object"}),
    "parallel_tool_calls": BOOLEAN,
    "reasoning_effort": STRING,
    "include_reasoning": BOOLEAN,
    "echo": BOOLEAN,
    "use_beam_search": BOOLEAN,
    "length_penalty": NUMBER,
    "stop_token_ids": TOKEN_IDS,
    "include_stop_str_in_output": BOOLEAN,
    "skip_special_tokens": BOOLEAN,
    "spaces_between_special_tokens": BOOLEAN,
    "truncate_prompt_tokens": INTEGER,
    "truncation_side": STRING,
    "prompt_logprobs": INTEGER,
    "logprob_token_ids": TOKEN_IDS,
    "allowed_token_ids": TOKEN_IDS,
    "bad_words": FieldType(_strs, "an array of strings", {"type": "array", "items": {"type": "string"}}),
    "add_special_tokens": BOOLEAN,
    "add_generation_prompt": BOOLEAN,
    "continue_final_message": BOOLEAN,
    "chat_template_kwargs": OBJECT,
    "documents": FieldType(_objects, "an array of objects", {"type": "array", "items": {"type": "object"}}),
    "media_io_kwargs": OBJECT,
    "return_tokens_as_token_ids": BOOLEAN,
    "return_token_ids": BOOLEAN,
    "return_prompt_text": BOOLEAN,
    "return_token_offsets": BOOLEAN,
    "return_mm_kwargs": BOOLEAN,
    "mm_payload": STRING,
    "suffix": STRING,
    "session_id": STRING,
    "watermarking": BOOLEAN,
    "stream_interval": INTEGER,
    "thinking_token_budget": INTEGER,
    "routed_experts_prompt_start": INTEGER,
    "repetition_detection": OBJECT,
    "store": BOOLEAN,
    "service_tier": STRING,
}
