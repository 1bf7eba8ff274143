"""What the engines read of a request, declared to the depth they read it: one rule for both sides.

The gateway (app/contract/requests.py) and the worker (app/worker/protocol.py) both check
these, so the gateway admits nothing that a worker or an engine would refuse, or fail on,
later. What the engines read:

- messages: ``role`` and ``content`` (a string, or text parts whose ``text`` is a string:
  the sim joins them, vLLM's chat template renders them); an assistant's ``tool_calls``
  (``function.name`` and ``function.arguments``) and a tool message's ``tool_call_id``,
  which chat templates render;
- ``tools``: ``function.name``, unique; ``function.parameters`` as an object whose
  ``properties`` is an object (the sim draws arguments from it, chat templates iterate it);
- ``tool_choice``: ``function.name``, which must name one of the tools;
- ``response_format``: ``type``, and for ``json_schema`` the object ``json_schema.schema``
  (vLLM's structured outputs).

Anything else a message, tool or format carries is allowed and passed on unread. A
failed check raises :class:`~app.contract.declared.BadInput` naming the parameter by its
path in the request (``tools[0].function.parameters``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, Tag, TypeAdapter, model_validator

from app.contract.declared import TAG, BadInput, Declared, by_json_type, by_type, checked, says, tagged

ROLES = ("assistant", "developer", "system", "tool", "user")
TOOL_CHOICES = ("none", "auto", "required")
MAX_NAME_CHARS = 256

Name = Annotated[
    str,
    Field(min_length=1, max_length=MAX_NAME_CHARS),
    says(f"must be a non-empty string of at most {MAX_NAME_CHARS} characters", wrong_type_too=True),
]


class TextPart(Declared):
    type: Literal["text"]
    text: str


Content = Annotated[str | list[TextPart], says("must be a string or an array of text parts", wrong_type_too=True)]


class CalledFunction(Declared):
    name: Name
    arguments: (
        Annotated[str | dict[str, Any], says("must be a string (JSON) or an object", wrong_type_too=True)] | None
    ) = None


class ToolCall(Declared):
    id: str | None = None
    function: CalledFunction


class Message(Declared):
    """One chat message: ``content`` is required but in an assistant's, which vLLM renders
    without it (its ``tool_calls`` or ``reasoning`` stand for it: a Responses API reasoning
    item handed back after a tool's output is such a message, as vLLM builds it)."""

    role: Annotated[Literal[ROLES], says(f"must be one of {', '.join(ROLES)}", wrong_type_too=True)]  # type: ignore[valid-type]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _calls_or_content(self) -> Message:
        if self.tool_calls is not None and self.role != "assistant":
            raise BadInput("tool_calls", "is only allowed on an assistant message")
        if self.content is None and self.role != "assistant":
            raise BadInput("content", "is required")
        return self


class Parameters(Declared):
    """A function's JSON schema: what the engines read of it."""

    properties: dict[str, Any] | None = None


class Function(Declared):
    name: Name
    description: str | None = None
    strict: bool | None = None
    parameters: Parameters | None = None


class Tool(Declared):
    type: Annotated[Literal["function"], says("must be 'function'", wrong_type_too=True)]
    function: Function


def _unique_names(tools: list[Tool]) -> list[Tool]:
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        if tool.function.name in seen:
            raise BadInput(f"[{index}].function.name", f"repeats the name {tool.function.name!r}")
        seen.add(tool.function.name)
    return tools


Tools = Annotated[list[Tool], AfterValidator(_unique_names)]


class ChosenFunction(Declared):
    name: Name


class NamedToolChoice(Declared):
    type: Annotated[Literal["function"], says("must be 'function'", wrong_type_too=True)] = "function"
    function: ChosenFunction


ToolChoice = Annotated[
    Annotated[
        Annotated[Literal[TOOL_CHOICES], says("must be none, auto, required or a named function")],  # type: ignore[valid-type]
        Tag(TAG + "str"),
    ]
    | Annotated[NamedToolChoice, Tag(TAG + "dict")],
    tagged(by_json_type(str, dict), "must be none, auto, required or a named function"),
]


class JsonSchema(Declared):
    schema_: dict[str, Any] = Field(alias="schema")
    name: str | None = None
    strict: bool | None = None


class PlainFormat(Declared):
    type: Annotated[
        Literal["text", "json_object"], says("must be text, json_object or json_schema", wrong_type_too=True)
    ]


class JsonSchemaFormat(Declared):
    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[
    Annotated[PlainFormat, Tag(TAG + "plain")] | Annotated[JsonSchemaFormat, Tag(TAG + "schema")],
    tagged(by_type({"json_schema": "schema"}, other="plain"), "must be an object"),
]

_MESSAGE: TypeAdapter[Message] = TypeAdapter(Message)
_TOOLS: TypeAdapter[list[Tool]] = TypeAdapter(Tools)
_TOOL_CHOICE: TypeAdapter[Any] = TypeAdapter(ToolChoice)
_RESPONSE_FORMAT: TypeAdapter[Any] = TypeAdapter(ResponseFormat)


def check_message(message: Any, param: str) -> None:
    """One chat message (``param`` is its path, e.g. ``messages[0]``)."""
    checked(_MESSAGE.validate_python, message, param)


def check_tools(value: Any, param: str = "tools") -> tuple[dict[str, Any], ...]:
    """``[{"type": "function", "function": {"name", "description"?, "parameters"?}}, …]``."""
    checked(_TOOLS.validate_python, value, param)
    return tuple(value)


def check_tool_choice(
    value: Any, tools: tuple[dict[str, Any], ...], param: str = "tool_choice"
) -> str | dict[str, Any]:
    """``none``, ``auto``, ``required`` (with tools) or ``{"type": "function", "function": {"name"}}``
    naming one of ``tools`` (already checked)."""
    checked(_TOOL_CHOICE.validate_python, value, param)
    choice_among(value, [tool["function"]["name"] for tool in tools], param)
    return value  # type: ignore[no-any-return]


def choice_among(choice: Any, names: list[str], param: str = "tool_choice") -> None:
    """A checked ``tool_choice`` against the request's tool names."""
    if choice == "required" and not names:
        raise BadInput(param, "'required' needs tools")
    if isinstance(choice, dict) and choice["function"]["name"] not in names:
        raise BadInput(f"{param}.function.name", f"names {choice['function']['name']!r}, which is not among the tools")


def check_response_format(value: Any, param: str = "response_format") -> dict[str, Any]:
    """``{"type": "text" | "json_object"}`` or ``{"type": "json_schema", "json_schema": {"schema": {…}}}``."""
    checked(_RESPONSE_FORMAT.validate_python, value, param)
    return value  # type: ignore[no-any-return]
