"""The chat completions and completions request bodies, declared field by field.

These models are vLLM 0.32's ``ChatCompletionRequest`` and ``CompletionRequest`` as a
client of phasegate may send them (docs/design.md §14; app/contract/request_fields.py says what
phasegate does with each field): every field vLLM declares, with its JSON type, and with
its range where phasegate reads it. A field the client did not send stays ``None`` and is
not sent on. Any field they do not declare is allowed, as vLLM allows it. Both the
gateway's checks (app/api/chat/request.py) and ``/openapi.json`` (app/api/openapi.py) come from
them; what JSON Schema cannot say (``stream_options`` only with ``stream``, a named
``tool_choice`` among the tools, a constraint given twice) is checked where the request is
built, with the same :class:`~app.contract.declared.BadInput`.

``max_tokens``, ``max_completion_tokens`` and ``n`` are bounded by the operator's limits:
:func:`request_models` gives the models for a gateway's limits.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

from pydantic import ConfigDict, Field, create_model

from app.contract.declared import Declared, says
from app.contract.engine_inputs import Message, ResponseFormat, ToolChoice, Tools
from app.contract.logprobs import MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS
from app.contract.request_fields import OWN, RECORDED, SET_BY_PHASEGATE, WHOLE_ONLY
from app.contract.vllm_extras import LEGACY_GUIDED, SamplingExtras

MAX_METADATA_KEYS = 16  # OpenAI's shape for metadata, which the log records (docs/compatibility.md)
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

TokenIds = Annotated[list[int], says("must be an array of token ids", wrong_type_too=True)]
Penalty = Annotated[float, Field(ge=-2, le=2), says("must be in [-2.0, 2.0]")]
Metadata = Annotated[
    dict[
        Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)],
        Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)],
    ],
    Field(max_length=MAX_METADATA_KEYS),
    says(
        f"must be an object of at most {MAX_METADATA_KEYS} strings (keys up to {MAX_METADATA_KEY_CHARS}"
        f" characters, values up to {MAX_METADATA_VALUE_CHARS})",
        wrong_type_too=True,
    ),
]
TopLogprobs = Annotated[
    int, Field(ge=0, le=MAX_TOP_LOGPROBS), says(f"must be an integer from 0 to {MAX_TOP_LOGPROBS}", wrong_type_too=True)
]
CompletionLogprobs = Annotated[
    int,
    Field(ge=0, le=MAX_COMPLETION_LOGPROBS),
    says(f"must be an integer from 0 to {MAX_COMPLETION_LOGPROBS}", wrong_type_too=True),
]
NonEmpty = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
PROMPT_FORMS = "a non-empty string, an array of them, an array of token ids, or an array of those"
Prompt = Annotated[
    NonEmpty
    | Annotated[list[NonEmpty], Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)],
    says(f"must be {PROMPT_FORMS}", wrong_type_too=True),
]


def _refused_fields(schema: dict[str, Any]) -> None:
    """The description of phasegate's own fields (never allowed) and of the whole-only ones
    (refused unless null), beside the declared ones."""
    schema["properties"] |= dict.fromkeys(sorted(OWN), False) | {name: {"type": "null"} for name in sorted(WHOLE_ONLY)}


class StreamOptions(Declared):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Request(SamplingExtras):
    """The fields both endpoints declare."""

    model_config = ConfigDict(json_schema_extra=_refused_fields)

    model: NonEmpty
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None  # bounded by request_models
    n: int | None = None  # bounded by request_models
    temperature: Annotated[float, Field(ge=0), says("must be at least 0.0")] | None = None
    top_p: Annotated[float, Field(gt=0, le=1), says("must be in (0.0, 1.0]")] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stop: Annotated[str | list[str], says("must be a string or an array of them", wrong_type_too=True)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1), says("must be a 64-bit signed integer")] | None = None
    user: str | None = None
    logit_bias: (
        Annotated[dict[str, float], says("must be an object of numbers by token id", wrong_type_too=True)] | None
    ) = None
    ignore_eos: bool | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    # a whole answer's (streamed: 0 only, as vLLM), app/contract/logprobs.requested_prompt_logprobs
    prompt_logprobs: (
        Annotated[int, Field(ge=-1), says("must be a positive value or -1", wrong_type_too=True)] | None
    ) = None
    logprob_token_ids: TokenIds | None = None
    allowed_token_ids: TokenIds | None = None
    bad_words: Annotated[list[str], says("must be an array of strings", wrong_type_too=True)] | None = None
    add_special_tokens: bool | None = None
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    return_token_offsets: bool | None = None
    routed_experts_prompt_start: int | None = None
    mm_payload: str | None = None
    return_mm_kwargs: bool | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    stream_interval: int | None = None
    echo: bool | None = None
    watermarking: bool | None = None
    metadata: Metadata | None = None  # recorded, not passed on
    store: bool | None = None  # recorded, not passed on
    service_tier: str | None = None  # recorded, not passed on


class ChatCompletionRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    max_completion_tokens: int | None = None  # bounded by request_models
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    documents: Annotated[list[dict[str, Any]], says("must be an array of objects", wrong_type_too=True)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    return_prompt_text: bool | None = None


def _prompt_or_embeds(schema: dict[str, Any]) -> None:
    _refused_fields(schema)
    schema["anyOf"] = [{"required": ["prompt"]}, {"required": ["prompt_embeds"]}]


class CompletionRequest(_Request):
    model_config = ConfigDict(json_schema_extra=_prompt_or_embeds)

    prompt: Prompt | None = None
    # instead of a prompt: base64 tensors, passed on (a replica may refuse them)
    prompt_embeds: NonEmpty | Annotated[list[str], Field(min_length=1)] | None = None
    suffix: str | None = None
    logprobs: CompletionLogprobs | None = None
    response_format: Any = None  # vLLM declares it; phasegate passes it on unread


_SET_APART = RECORDED | SET_BY_PHASEGATE | frozenset(LEGACY_GUIDED)
PASSED_CHAT = frozenset(ChatCompletionRequest.model_fields) - _SET_APART
PASSED_COMPLETIONS = frozenset(CompletionRequest.model_fields) - _SET_APART


@functools.cache
def request_models(max_tokens: int | None, max_n: int) -> tuple[type[ChatCompletionRequest], type[CompletionRequest]]:
    """The request models under the operator's limits: ``max_tokens`` (``None``: no ceiling)
    and ``max_n`` choices."""
    tokens_why = f"must be between 1 and {max_tokens}" if max_tokens is not None else "must be at least 1"
    tokens: Any = (Annotated[int, Field(ge=1, le=max_tokens), says(tokens_why)] | None, None)
    n: Any = (Annotated[int, Field(ge=1, le=max_n), says(f"must be between 1 and {max_n}")] | None, None)
    chat = create_model(
        "CreateChatCompletionRequest",
        __base__=ChatCompletionRequest,
        __module__=__name__,
        max_tokens=tokens,
        max_completion_tokens=tokens,
        n=n,
    )
    completion = create_model(
        "CreateCompletionRequest", __base__=CompletionRequest, __module__=__name__, max_tokens=tokens, n=n
    )
    return chat, completion
