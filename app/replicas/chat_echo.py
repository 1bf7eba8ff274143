"""A chat completion's ``echo`` through an ``openai`` replica: the text vLLM's server sends
before the answer, made by the gateway (docs/compatibility.md).

vLLM's chat ``echo: true`` sends the last message's content before each choice's answer
when that message is in the answer's role: the assistant's, or without a generation prompt
the last message's own (a continued message); its text parts joined by a line break. vLLM
0.32's streamed answer fails to (it answers an error object: its conversation holds the
content as parts, which its stream's delta cannot take), and phasegate streams every
upstream answer, so the gateway asks the replica without ``echo`` and sends the echo
itself, where vLLM's stream would (app/replicas/openai_stream.py): after each choice's role
chunk. A ``phasegate worker --engine vllm`` echoes with vLLM's own rendering of the
conversation (app/worker/vllm_requests.py ``echoed``), to the same text.
"""

from __future__ import annotations

from typing import Any


def chat_echo(passed: dict[str, Any]) -> str:
    """What a chat request's ``echo`` sends before its answer ("" for none)."""
    messages = passed.get("messages")
    if passed.get("echo") is not True or not isinstance(messages, list) or not messages:
        return ""
    last = messages[-1] if isinstance(messages[-1], dict) else {}
    role = "assistant" if passed.get("add_generation_prompt") is not False else last.get("role")
    if last.get("role") != role:
        return ""
    content = last.get("content") or ""
    if isinstance(content, str):
        return content
    return "\n".join(str(part.get("text") or "") for part in content if isinstance(part, dict) and "text" in part)
