"""The Anthropic Messages API request bodies (``POST /v1/messages``, ``POST
/v1/messages/count_tokens``), declared field by field (docs/design.md §17, docs/messages.md).

What phasegate serves of Anthropic's ``MessageCreateParams``, as ``vllm serve`` reads it: the
sampling fields take the chat request's own declaration (app/contract/requests.py); the
ones read and turned into a chat completion (``system``, ``messages`` and their content
blocks, ``tools``, ``tool_choice``, ``thinking``, ``metadata``, ``output_config``) are
declared here to the depth they are read; a value phasegate understands and does not serve
(a server tool, a ``document`` block) is :class:`~app.contract.declared.NotServed`; a field it
does not serve at all is in :data:`NOT_SERVED`, refused by name; any other field is not
allowed. The gateway's checks (app/api/messages/request.py) and ``/openapi.json`` both come
from :func:`messages_model`.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, Tag, create_model

from app.contract.declared import TAG, Declared, NotServed, by_json_type, by_type, says, tagged
from app.contract.engine_inputs import Name
from app.contract.requests import request_models

MIN_THINKING_BUDGET = 1024  # Anthropic's and vLLM's floor for thinking.budget_tokens
BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
# (an image is not among them: the chat completions phasegate serves take text parts only)
# passed on to the chat completion under the same name
PASSED_AS_IS = ("model", "stream", "temperature", "top_p", "top_k")
NOT_SERVED = {
    "container": "phasegate runs no code-execution containers",
    "mcp_servers": "phasegate connects to no MCP servers: run the tools on the client's side",
    "context_management": "phasegate edits no context: send the messages the model should see",
    "service_tier": "phasegate has no priority capacity to choose",
    "inference_geo": "a replica's region is the operator's choice, not a request's",
    "speed": "phasegate has no fast mode to choose",
    "diagnostics": "phasegate keeps no prompt-cache diagnostics",
    "cache_control": "vLLM's prefix cache is automatic: there is no marker to place",
}


class CacheControl(Declared):
    model_config = ConfigDict(extra="forbid")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Declared):
    """A text block; ``cache_control`` is taken and has nothing to do: vLLM caches prefixes by itself."""

    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: Annotated[None, says("are not served: phasegate cites no documents", not_served=True)] = None


ResultPart = Annotated[
    Annotated[TextBlock, Tag(TAG + "text")] | Annotated["OtherResultPart", Tag(TAG + "other")],
    tagged(by_type({"text": "text"}), "must be a text block"),
]


class OtherResultPart(Declared):
    """A tool result's part that is not text (an image): the chat phasegate serves takes text parts only."""

    type: Annotated[Any, BeforeValidator(lambda kind: _not_text(kind))]


def _not_text(kind: Any) -> Any:
    raise NotServed("", f"is a '{kind}' block; a tool result takes text blocks")


class ToolUseBlock(Declared):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: Name
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(Declared):
    """A tool's result; ``is_error`` is taken as vLLM takes it: the model sees the content alone."""

    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: Annotated[str | list[ResultPart], says("must be a string or a list of text blocks")] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(Declared):
    """Reasoning handed back: the assistant message's ``reasoning``; its signature is not checked."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Declared):
    """Reasoning the client cannot read: left out, as vLLM leaves it."""

    type: Literal["redacted_thinking"]
    data: str


def _a_block_served(kind: Any) -> Any:
    raise NotServed("", f"is a '{kind}' block; phasegate takes {', '.join(BLOCKS[:-1])} and {BLOCKS[-1]} blocks")


class OtherBlock(Declared):
    type: Annotated[Any, BeforeValidator(_a_block_served)]


Block = Annotated[
    Annotated[TextBlock, Tag(TAG + "text")]
    | Annotated[ToolUseBlock, Tag(TAG + "tool_use")]
    | Annotated[ToolResultBlock, Tag(TAG + "tool_result")]
    | Annotated[ThinkingBlock, Tag(TAG + "thinking")]
    | Annotated[RedactedThinkingBlock, Tag(TAG + "redacted_thinking")]
    | Annotated[OtherBlock, Tag(TAG + "other")],
    tagged(by_type({kind: kind for kind in BLOCKS}), "must be a content block (an object with a type)"),
]
_CONTENT = "must be a string or a list of content blocks"


class MessageParam(Declared):
    model_config = ConfigDict(extra="forbid")
    role: Annotated[Literal["user", "assistant"], says("must be user or assistant", wrong_type_too=True)]
    content: Annotated[
        Annotated[str, Tag(TAG + "str")] | Annotated[list[Block], Tag(TAG + "list")],
        tagged(by_json_type(str, list), _CONTENT),
    ]


def _tools_served(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type", "custom") != "custom":
        raise NotServed("type", f"is a '{value.get('type')}' tool; phasegate runs no server tools, only custom tools")
    return value


class InputSchema(Declared):
    type: Literal["object"]
    properties: dict[str, Any] | None = None


class CustomTool(Declared):
    model_config = ConfigDict(extra="forbid")
    type: Literal["custom"] | None = None
    name: Name
    description: str | None = None
    input_schema: InputSchema
    strict: bool | None = None
    cache_control: CacheControl | None = None


class ToolChoiceAny(Declared):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "none"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(Declared):
    model_config = ConfigDict(extra="forbid")
    type: Literal["tool"]
    name: Name
    disable_parallel_tool_use: bool | None = None


ToolChoice = Annotated[
    Annotated[ToolChoiceAny, Tag(TAG + "any")] | Annotated[ToolChoiceTool, Tag(TAG + "tool")],
    tagged(by_type({"tool": "tool"}, other="any"), "must be an object of type auto, any, tool or none"),
]


class ThinkingEnabled(Declared):
    model_config = ConfigDict(extra="forbid")
    type: Literal["enabled"]
    budget_tokens: Annotated[
        int, Field(ge=MIN_THINKING_BUDGET), says(f"must be an integer of at least {MIN_THINKING_BUDGET}")
    ]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingOther(Declared):
    model_config = ConfigDict(extra="forbid")
    type: Annotated[Literal["disabled", "adaptive"], says("must be enabled, disabled or adaptive", wrong_type_too=True)]


Thinking = Annotated[
    Annotated[ThinkingEnabled, Tag(TAG + "enabled")] | Annotated[ThinkingOther, Tag(TAG + "other")],
    tagged(by_type({"enabled": "enabled"}, other="other"), "must be an object"),
]


class MessagesMetadata(Declared):
    model_config = ConfigDict(extra="forbid")
    user_id: Annotated[str, Field(max_length=256), says("must be a string of at most 256 characters")] | None = None


class OutputFormat(Declared):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Declared):
    model_config = ConfigDict(extra="forbid")
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class _Prompt(Declared):
    """What both routes read: the conversation and what the model is told of its tools."""

    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, Field(min_length=1)]
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: Annotated[str | list[TextBlock], says("must be a string or a list of text blocks")] | None = None
    tools: list[Annotated[CustomTool, BeforeValidator(_tools_served)]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(_Prompt):
    """``POST /v1/messages``; :func:`messages_model` adds the passed-on fields, as the chat request declares them."""

    max_tokens: int  # bounded by messages_model, as the chat's max_tokens
    stop_sequences: Annotated[list[str], says("must be an array of strings", wrong_type_too=True)] | None = None
    metadata: MessagesMetadata | None = None


class CountTokensRequest(_Prompt):
    """``POST /v1/messages/count_tokens``: the prompt alone."""


@functools.cache
def messages_model(max_tokens: int | None, max_n: int) -> type[MessagesRequest]:
    """The Messages request model under the operator's limits (those of the chat request each
    attempt makes): ``max_tokens`` is required, as Anthropic requires it."""
    chat, _ = request_models(max_tokens, max_n)
    passed: Any = {
        name: (chat.model_fields[name].annotation, chat.model_fields[name]) for name in PASSED_AS_IS if name != "model"
    }
    refused: Any = {name: (None, None) for name in NOT_SERVED}
    bounded: Any = chat.model_fields["max_tokens"].annotation
    tokens: Any = (bounded.__args__[0], ...)  # (the chat's is optional: ``Annotated[int, …] | None``)
    return create_model(
        "CreateMessageRequest", __base__=MessagesRequest, __module__=__name__, max_tokens=tokens, **passed, **refused
    )
