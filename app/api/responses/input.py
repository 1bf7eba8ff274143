"""A Responses API request's input (``instructions`` and ``input``) as chat messages,
built as vLLM's own Responses server builds them (docs/design.md §15).

``instructions`` is a system message first; a message item is a message (its
``input_text``/``output_text`` parts text parts, an ``input_image`` by URL an image
part); ``function_call`` items join the assistant message before them as its tool
calls, ``function_call_output`` items are tool messages, and a reasoning item handed
back is the assistant message's ``reasoning``. Any other item was refused, naming it,
by the request's declaration (app/contract/responses.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def chat_messages(instructions: str | None, given: Any, earlier: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """The chat messages of ``instructions``, the conversation's ``earlier`` turns and
    ``input`` (checked against its declaration: app/contract/responses.py), as vLLM
    builds them (an earlier turn's instructions do not carry over)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages.extend(message for message in earlier if message.get("role") != "system")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
        return messages
    for item in given:
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item))
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            previous = _open_assistant(messages)
            if previous is not None and "tool_calls" in previous:
                previous["tool_calls"].append(call)
            elif previous is not None:
                previous["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:  # reasoning, handed back: its text
            name = "content" if item.get("content") else "summary"
            text = "".join(part.get("text", "") for part in item.get(name) or ())
            previous = _open_assistant(messages)
            if previous is not None and "reasoning" not in previous:
                previous["reasoning"] = text
            else:
                messages.append({"role": "assistant", "content": None, "reasoning": text})
    return messages


def _open_assistant(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last message, when it is the assistant's (a turn's items join into it)."""
    return messages[-1] if messages and messages[-1].get("role") == "assistant" else None


def _message(item: dict[str, Any]) -> dict[str, Any]:
    content = item["content"]
    if isinstance(content, str):
        return {"role": item["role"], "content": content}
    parts = [
        {"type": "text", "text": part["text"]}
        if part["type"] != "input_image"
        else {"type": "image_url", "image_url": {"url": part["image_url"]}}
        for part in content
    ]
    return {"role": item["role"], "content": parts}
