"""The Responses API request body (``POST /v1/responses``), declared field by field.

What phasegate serves of OpenAI's ``CreateResponseRequest`` (docs/design.md §15,
docs/responses.md): the fields passed on to the chat completion each attempt asks for
take the chat request's own declaration (app/contract/requests.py); the ones read and
translated (``input``, ``tools``, ``text``, ``reasoning``…) are declared here to the depth
they are read; a value phasegate understands and does not serve (a built-in tool, a
reasoning summary, ``truncation: auto``) is :class:`~app.contract.declared.NotServed`; a
field it does not serve at all is declared null only, and refused by name before this;
any other field is not allowed. The gateway's checks (app/api/responses/request.py) and
``/openapi.json`` both come from :func:`responses_model`. What JSON Schema cannot say
(``store: false`` with ``background``, ``stream_options`` only with ``stream``) is checked
where the chat body is built.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    Tag,
    create_model,
    model_validator,
)

from app.contract.declared import TAG, BadInput, Declared, NotServed, by_json_type, by_type, says, tagged
from app.contract.requests import TopLogprobs, request_models

ROLES = ("assistant", "developer", "system", "user")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
INCLUDE_SERVED = ("message.output_text.logprobs",)
ITEMS = ("message", "function_call", "function_call_output", "reasoning")
# passed on to the chat completion under the same name, as the client sent them
PASSED_AS_IS = (
    "model",
    "stream",
    "temperature",
    "top_p",
    "user",
    "metadata",
    "parallel_tool_calls",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "seed",
    "repetition_penalty",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "service_tier",
)
NOT_SERVED = {
    "conversation": "conversations are not kept by phasegate; send the earlier turns as input items",
    "prompt": "prompt templates are OpenAI's hosted feature",
    "max_tool_calls": "phasegate does not run built-in tools, so there is no tool-call budget to apply",
    "prompt_cache_key": "the prefix cache is keyed per tenant by phasegate (docs/design.md §13)",
    "safety_identifier": "phasegate runs no safety system to give it to",
}


class InputText(Declared):
    type: Literal["input_text", "output_text"]
    text: str


class InputImage(Declared):
    type: Literal["input_image"]
    image_url: str  # by URL


_PART = "must be an input_text, output_text or input_image (by URL) part"


class OtherPart(Declared):
    @model_validator(mode="before")
    @classmethod
    def _refused(cls, value: Any) -> Any:
        raise BadInput("", _PART)


Part = Annotated[
    Annotated[InputText, Tag(TAG + "text")]
    | Annotated[InputImage, Tag(TAG + "image")]
    | Annotated[OtherPart, Tag(TAG + "other")],
    tagged(by_type({"input_text": "text", "output_text": "text", "input_image": "image"}), _PART),
]


class MessageItem(Declared):
    type: Literal["message"] = "message"
    role: Annotated[Literal[ROLES], says(f"must be one of {', '.join(ROLES)}", wrong_type_too=True)]  # type: ignore[valid-type]
    content: Annotated[
        Annotated[str, Tag(TAG + "str")] | Annotated[list[Part], Tag(TAG + "list")],
        tagged(by_json_type(str, list), "must be a string or a list of parts"),
    ]


class FunctionCallItem(Declared):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Declared):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningText(Declared):
    text: str = ""


_TEXTS = "must be a list of text parts"


class ReasoningItem(Declared):
    """A reasoning item handed back: its text (its content's, else its summary's), never encrypted content."""

    type: Literal["reasoning"]
    content: Annotated[list[ReasoningText], says(_TEXTS, wrong_type_too=True)] | None = None
    summary: Annotated[list[ReasoningText], says(_TEXTS, wrong_type_too=True)] | None = None
    encrypted_content: Annotated[None, says("is not supported: give the reasoning's text", wrong_type_too=True)] = None


def _an_item_served(kind: Any) -> Any:
    raise BadInput("", f"is a '{kind}' item; phasegate takes {', '.join(ITEMS[:-1])} and {ITEMS[-1]} items")


class OtherItem(Declared):
    type: Annotated[Any, AfterValidator(_an_item_served)]


Item = Annotated[
    Annotated[MessageItem, Tag(TAG + "message")]
    | Annotated[FunctionCallItem, Tag(TAG + "function_call")]
    | Annotated[FunctionCallOutputItem, Tag(TAG + "function_call_output")]
    | Annotated[ReasoningItem, Tag(TAG + "reasoning")]
    | Annotated[OtherItem, Tag(TAG + "other")],
    tagged(by_type({kind: kind for kind in ITEMS}, "message"), "must be an object"),
]
_INPUT = "must be a string or a non-empty list of input items"


def _not_empty(items: list[Any]) -> list[Any]:
    if not items:
        raise BadInput("", _INPUT)
    return items


Input = Annotated[
    Annotated[str, Tag(TAG + "str")]
    | Annotated[list[Item], Field(json_schema_extra={"minItems": 1}), AfterValidator(_not_empty), Tag(TAG + "list")],
    tagged(by_json_type(str, list), _INPUT),
]


def _tools_served(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") != "function":
        raise NotServed(
            "type", f"is a '{value.get('type')}' tool; phasegate runs no built-in tools, only function tools"
        )
    return value


class FunctionTool(Declared):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Declared):
    type: Literal["function"]
    name: str


ToolChoice = Annotated[
    Annotated[Literal["auto", "none", "required"], Tag(TAG + "str")] | Annotated[NamedFunction, Tag(TAG + "dict")],
    tagged(by_json_type(str, dict), "must be 'auto', 'none', 'required' or {'type': 'function', 'name': …}"),
]


class PlainTextFormat(Declared):
    type: Annotated[
        Literal["text", "json_object"], says("must be text, json_object or json_schema", wrong_type_too=True)
    ]


class JsonSchemaTextFormat(Declared):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


TextFormat = Annotated[
    Annotated[PlainTextFormat, Tag(TAG + "plain")] | Annotated[JsonSchemaTextFormat, Tag(TAG + "json_schema")],
    tagged(by_type({"json_schema": "json_schema"}, other="plain"), "must be an object"),
]


class Text(Declared):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: (
        Annotated[Literal["medium"], says("is not served: the replica's model has none", not_served=True)] | None
    ) = None


_SUMMARIES = "reasoning summaries are not served: the replica's reasoning is given whole"


class Reasoning(Declared):
    model_config = ConfigDict(extra="forbid")
    effort: Annotated[Literal[EFFORTS], says(f"must be one of {', '.join(EFFORTS)}", wrong_type_too=True)] | None = None  # type: ignore[valid-type]
    summary: Annotated[None, says(_SUMMARIES, wrong_type_too=True, not_served=True)] = None
    generate_summary: Annotated[None, says(_SUMMARIES, wrong_type_too=True, not_served=True)] = None


class ResponsesStreamOptions(Declared):
    model_config = ConfigDict(extra="forbid")
    include_obfuscation: Any = None


class ResponsesRequest(Declared):
    """The fields read here; :func:`responses_model` adds the passed-on ones, as the chat request declares them."""

    model_config = ConfigDict(extra="forbid")

    input: Input
    instructions: str | None = None
    tools: list[Annotated[FunctionTool, BeforeValidator(_tools_served)]] | None = None
    tool_choice: ToolChoice | None = None
    text: Text | None = None
    max_output_tokens: int | None = None  # bounded by responses_model, as the chat's max_tokens
    top_logprobs: TopLogprobs | None = None
    include: (
        list[Annotated[Literal[INCLUDE_SERVED], says("is not served by phasegate", not_served=True)]]  # type: ignore[valid-type]
        | None
    ) = None
    reasoning: Reasoning | None = None
    store: bool | None = None
    truncation: (
        Annotated[
            Literal["disabled"],
            says("must be 'disabled': an input longer than the context is refused, never cut", not_served=True),
        ]
        | None
    ) = None
    background: bool | None = None
    previous_response_id: str | None = None
    stream_options: ResponsesStreamOptions | None = None


@functools.cache
def responses_model(max_tokens: int | None, max_n: int) -> type[ResponsesRequest]:
    """The Responses request model under the operator's limits (those of the chat request
    each attempt makes: ``max_output_tokens`` is its ``max_tokens``)."""
    chat, _ = request_models(max_tokens, max_n)
    passed: Any = {name: (chat.model_fields[name].annotation, chat.model_fields[name]) for name in PASSED_AS_IS}
    refused: Any = {name: (None, None) for name in NOT_SERVED}
    tokens: Any = (chat.model_fields["max_tokens"].annotation, chat.model_fields["max_tokens"])
    return create_model(
        "CreateResponseRequest",
        __base__=ResponsesRequest,
        __module__=__name__,
        max_output_tokens=tokens,
        **passed,
        **refused,
    )
