"""What the engines read of a request, checked to the depth they read it: one rule for both sides.

The gateway (app/api/schemas.py) and the worker (app/worker/protocol.py) both call these checks, so
the gateway admits nothing that a worker or an engine would refuse, or fail on, later.
What the engines read:

- messages: ``role`` and ``content`` (a string, or text parts whose ``text`` is a string:
  the sim joins them, vLLM's chat template renders them); an assistant's ``tool_calls``
  (``function.name`` and ``function.arguments``) and a tool message's ``tool_call_id``,
  which chat templates render;
- ``tools``: ``function.name``; ``function.parameters`` as an object whose ``properties``
  is an object (the sim draws arguments from it, chat templates iterate it);
- ``tool_choice``: ``function.name``, which must name one of the tools;
- ``response_format``: ``type``, and for ``json_schema`` the object ``json_schema.schema``
  (vLLM's structured outputs).

A failed check raises :class:`BadInput` naming the parameter by its path in the request
(``tools[0].function.parameters``); each side words and wraps it in its own error shape.
"""

from __future__ import annotations

from typing import Any

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
TOOL_CHOICES = ("none", "auto", "required")
MAX_NAME_CHARS = 256


class BadInput(ValueError):
    """``param`` (a path such as ``messages[2].content``) ``why`` (``must be a string``)."""

    def __init__(self, param: str, why: str) -> None:
        super().__init__(f"'{param}' {why}")
        self.param = param
        self.why = why


def _object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadInput(param, "must be an object")
    return value


def _name(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS:
        raise BadInput(param, f"must be a non-empty string of at most {MAX_NAME_CHARS} characters")
    return value


def _optional(container: dict[str, Any], key: str, expected: type, param: str, what: str) -> None:
    value = container.get(key)
    if value is not None and (not isinstance(value, expected) or (expected is int and isinstance(value, bool))):
        raise BadInput(f"{param}.{key}", f"must be {what}")


# --- messages ----------------------------------------------------------------------------


def check_message(message: Any, param: str) -> None:
    """One chat message (``param`` is its path, e.g. ``messages[0]``)."""
    if not isinstance(message, dict):
        raise BadInput(param, "must be an object")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:  # a list or an object is not even hashable
        raise BadInput(f"{param}.role", f"must be one of {', '.join(sorted(ROLES))}")
    content = message.get("content")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant":
            raise BadInput(f"{param}.tool_calls", "is only allowed on an assistant message")
        _check_tool_calls(tool_calls, f"{param}.tool_calls")
    if content is None and not tool_calls:
        raise BadInput(f"{param}.content", "is required")
    if content is not None:
        check_content(content, f"{param}.content")
    _optional(message, "name", str, param, "a string")
    _optional(message, "tool_call_id", str, param, "a string")


def check_content(content: Any, param: str) -> None:
    """A message's content: a string, or a list of ``{"type": "text", "text": "…"}`` parts."""
    if isinstance(content, str):
        return
    if isinstance(content, list) and all(_is_text_part(part) for part in content):
        return
    raise BadInput(param, "must be a string or an array of text parts")


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def _check_tool_calls(value: Any, param: str) -> None:
    if not isinstance(value, list):
        raise BadInput(param, "must be an array")
    for index, call in enumerate(value):
        where = f"{param}[{index}]"
        _object(call, where)
        _optional(call, "id", str, where, "a string")
        function = _object(call.get("function"), f"{where}.function")
        _name(function.get("name"), f"{where}.function.name")
        arguments = function.get("arguments")
        if arguments is not None and not isinstance(arguments, str | dict):
            raise BadInput(f"{where}.function.arguments", "must be a string (JSON) or an object")


# --- tools -------------------------------------------------------------------------------


def check_tools(value: Any, param: str = "tools") -> tuple[dict[str, Any], ...]:
    """``[{"type": "function", "function": {"name", "description"?, "parameters"?}}, …]``."""
    if not isinstance(value, list):
        raise BadInput(param, "must be an array")
    names: set[str] = set()
    for index, tool in enumerate(value):
        where = f"{param}[{index}]"
        _object(tool, where)
        if tool.get("type") != "function":
            raise BadInput(f"{where}.type", "must be 'function'")
        function = _object(tool.get("function"), f"{where}.function")
        name = _name(function.get("name"), f"{where}.function.name")
        if name in names:
            raise BadInput(f"{where}.function.name", f"repeats the name {name!r}")
        names.add(name)
        _optional(function, "description", str, f"{where}.function", "a string")
        _optional(function, "strict", bool, f"{where}.function", "a boolean")
        parameters = function.get("parameters")
        if parameters is not None:
            schema = _object(parameters, f"{where}.function.parameters")
            properties = schema.get("properties")
            if properties is not None:
                _object(properties, f"{where}.function.parameters.properties")
    return tuple(value)


def check_tool_choice(
    value: Any, tools: tuple[dict[str, Any], ...], param: str = "tool_choice"
) -> str | dict[str, Any]:
    """``none``, ``auto``, ``required`` (with tools) or ``{"type": "function", "function": {"name"}}``
    naming one of ``tools`` (already checked)."""
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise BadInput(param, "must be none, auto, required or a named function")
        if value == "required" and not tools:
            raise BadInput(param, "'required' needs tools")
        return value
    choice = _object(value, param)
    if choice.get("type", "function") != "function":
        raise BadInput(f"{param}.type", "must be 'function'")
    function = _object(choice.get("function"), f"{param}.function")
    name = _name(function.get("name"), f"{param}.function.name")
    if name not in {tool["function"]["name"] for tool in tools}:
        raise BadInput(f"{param}.function.name", f"names {name!r}, which is not among the tools")
    return choice


def check_response_format(value: Any, param: str = "response_format") -> dict[str, Any]:
    """``{"type": "text" | "json_object"}`` or ``{"type": "json_schema", "json_schema": {"schema": {…}}}``."""
    response_format = _object(value, param)
    kind = response_format.get("type")
    if not isinstance(kind, str) or kind not in RESPONSE_FORMATS:
        raise BadInput(f"{param}.type", "must be text, json_object or json_schema")
    if kind == "json_schema":
        json_schema = _object(response_format.get("json_schema"), f"{param}.json_schema")
        _object(json_schema.get("schema"), f"{param}.json_schema.schema")
        _optional(json_schema, "name", str, f"{param}.json_schema", "a string")
        _optional(json_schema, "strict", bool, f"{param}.json_schema", "a boolean")
    return response_format
