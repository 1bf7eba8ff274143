"""A Responses API request's input (``instructions`` and ``input``) as chat messages,
built as vLLM's own Responses server builds them (DESIGN.md §15).

``instructions`` is a system message first; a message item is a message (its
``input_text``/``output_text`` parts text parts, an ``input_image`` by URL an image
part); ``function_call`` items join the assistant message before them as its tool
calls, ``function_call_output`` items are tool messages, and a reasoning item handed
back is the assistant message's ``reasoning``. Any other item is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.api.errors import InvalidRequest

ROLES = {"user", "system", "developer", "assistant"}


def chat_messages(instructions: str | None, given: Any, earlier: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """The chat messages of ``instructions``, the conversation's ``earlier`` turns and
    ``input``, as vLLM builds them (an earlier turn's instructions do not carry over)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages.extend(message for message in earlier if message.get("role") != "system")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
        return messages
    if not isinstance(given, list) or not given:
        raise InvalidRequest("'input' must be a string or a non-empty list of input items", param="input")
    for n, item in enumerate(given):
        param = f"input[{n}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"'{param}' must be an object", param=param)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, param))
        elif kind == "function_call":
            call = {
                "id": _field_str(item, "call_id", param),
                "type": "function",
                "function": {
                    "name": _field_str(item, "name", param),
                    "arguments": _field_str(item, "arguments", param),
                },
            }
            previous = _open_assistant(messages)
            if previous is not None and "tool_calls" in previous:
                previous["tool_calls"].append(call)
            elif previous is not None:
                previous["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise InvalidRequest(f"'{param}.output' must be a string", param=f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": _field_str(item, "call_id", param), "content": output})
        elif kind == "reasoning":
            if item.get("encrypted_content"):
                raise InvalidRequest("encrypted reasoning content is not supported", param=f"{param}.encrypted_content")
            text = _reasoning_text(item, param)
            previous = _open_assistant(messages)
            if previous is not None and "reasoning" not in previous:
                previous["reasoning"] = text
            else:
                messages.append({"role": "assistant", "content": None, "reasoning": text})
        else:
            raise InvalidRequest(
                f"'{param}' is a '{kind}' item; phasegate takes message, function_call, function_call_output"
                " and reasoning items",
                param=f"{param}.type",
            )
    return messages


def _open_assistant(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last message, when it is the assistant's (a turn's items join into it)."""
    return messages[-1] if messages and messages[-1].get("role") == "assistant" else None


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"'{param}.role' must be one of {', '.join(sorted(ROLES))}", param=f"{param}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise InvalidRequest(f"'{param}.content' must be a string or a list of parts", param=f"{param}.content")
    parts: list[dict[str, Any]] = []
    for k, part in enumerate(content):
        where = f"{param}.content[{k}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):
            parts.append({"type": "text", "text": _field_str(part, "text", where)})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise InvalidRequest(
                f"'{where}' must be an input_text, output_text or input_image (by URL) part", param=where
            )
    return {"role": role, "content": parts}


def _reasoning_text(item: dict[str, Any], param: str) -> str:
    """A reasoning item's text: its content's parts, else its summary's."""
    name = "content" if item.get("content") else "summary"
    parts = item.get(name) or []
    if not isinstance(parts, list) or not all(
        isinstance(part, dict) and isinstance(part.get("text", ""), str) for part in parts
    ):
        raise InvalidRequest(f"'{param}.{name}' must be a list of text parts", param=f"{param}.{name}")
    return "".join(part.get("text", "") for part in parts)


def _field_str(item: dict[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise InvalidRequest(f"'{param}.{name}' must be a string", param=f"{param}.{name}")
    return value
