"""The same request to ``vllm serve`` and through phasegate, and what differs.

An answer is compared as a client reads it: the JSON of a whole answer, or a stream as a
client accumulates its chunks (:func:`accumulated`); an error as its status and the
``param`` it names (a stream carrying an error object, as vLLM streams what its engine
refuses once the stream began, is that error, its status the object's ``code``). What
legitimately differs between two servers is set aside first (:func:`normalized`): each
answer's own id and creation time, the ids vLLM draws for tool calls, and a field that is
null on one side and absent on the other (no client tells them apart). Everything else
must be equal: a difference is named by its path.

Why a stream is accumulated rather than compared chunk by chunk: where chunks fall is not
vLLM's to repeat. Its engine merges the tokens of a slow reader into one output, stop
strings hold text back, and the choices of ``n > 1`` or a batch interleave as the engine
schedules them; two runs of the same request to ``vllm serve`` differ there. What a
client can rely on is kept: per choice, its role, its text in order and the fields it came
under, in order (consecutive pieces of one field joined; a chunk's reasoning before its
content), every token's log probabilities, its tool calls
as accumulated, its finish and stop reasons and any other field; and the stream's own
fields (usage, prompt token ids). Where a stream's reasoning ends and its content begins
is not compared: vLLM's streaming reasoning parser places it by how the engine grouped
the tokens, and with stop strings holding text back two runs of ``vllm serve`` cut
``</think>`` at different places (a whole answer's split is compared, and
tests/app/api/test_reasoning.py holds phasegate's own). ``stream_chunks`` keeps the raw chunks for the cases
that compare them (the finish chunk, a documented divergence).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import httpx

VOLATILE = {"id", "created", "system_fingerprint"}
REASONING = {"reasoning", "reasoning_content"}  # an answer's own; phasegate's are its own
_TOOL_CALL_ID = re.compile(r"^(chatcmpl-tool-|call_)[0-9A-Za-z_-]+$")


@dataclass(frozen=True)
class Answer:
    """What a client got: the status, and the whole answer, the stream's chunks, or the error."""

    status: int
    body: Any

    @property
    def error_param(self) -> Any:
        if self.status < 400 or not isinstance(self.body, dict):
            return None
        return (self.body.get("error") or {}).get("param")


def ask(http: httpx.Client, base_url: str, path: str, body: dict[str, Any]) -> Answer:
    """POST ``body`` to ``base_url + path``; a streamed answer is read to its end."""
    url = base_url + path
    if not body.get("stream"):
        response = http.post(url, json=body)
        return Answer(response.status_code, response.json())
    chunks = stream_chunks(http, url, body)
    if isinstance(chunks, Answer):
        return chunks
    return Answer(200, accumulated(chunks))


def stream_chunks(http: httpx.Client, url: str, body: dict[str, Any]) -> list[dict[str, Any]] | Answer:
    """A streamed answer's chunks as sent (its ``data:`` lines before ``[DONE]``), or the refusal."""
    with http.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            return Answer(response.status_code, json.loads(response.read()))
        chunks = []
        for line in response.iter_lines():
            if line.startswith("data:"):
                data = line[5:].strip()
                if data != "[DONE]":
                    chunks.append(json.loads(data))
    for chunk in chunks:  # an error object in the stream (vLLM's refusal once its stream began): the error
        if isinstance(chunk.get("error"), dict) and type(chunk["error"].get("code")) is int:
            return Answer(chunk["error"]["code"], chunk)
    return chunks


def accumulated(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream as a client accumulates it (the module docstring)."""
    stream: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        stream |= {k: v for k, v in chunk.items() if k != "choices" and v is not None}
        for choice in chunk.get("choices") or ():
            got = choices.setdefault(choice.get("index", 0), {"texts": [], "tool_calls": {}})
            delta = choice.get("delta")
            fields = list(delta.items()) if isinstance(delta, dict) else [("text", choice.get("text"))]
            fields.sort(key=lambda field: field[0] not in REASONING)  # generated first, whatever the JSON order
            for key, value in fields:
                if key == "tool_calls":
                    add_tool_calls(got["tool_calls"], value or ())
                elif isinstance(value, str) and key != "role":
                    _add_text(got["texts"], key, value)
                elif value is not None:
                    got[key] = value
            _add_logprobs(got, choice.get("logprobs"))
            for key, value in choice.items():
                if key in ("index", "delta", "text", "logprobs") or value is None:
                    continue
                if key == "token_ids":
                    got.setdefault(key, []).extend(value)
                else:
                    got[key] = value
    for got in choices.values():  # the text in order, and the fields it came under, in order
        runs = got.pop("texts")
        got["text"], got["fields"] = "".join(text for _, text in runs), [key for key, _ in runs]
    stream["choices"] = [choices[index] for index in sorted(choices)]
    return stream


def _add_text(texts: list[list[str]], key: str, text: str) -> None:
    if not text:
        return
    if texts and texts[-1][0] == key:
        texts[-1][1] += text
    else:
        texts.append([key, text])


def add_tool_calls(calls: dict[int, dict[str, Any]], pieces: Any) -> None:
    for piece in pieces:
        call = calls.setdefault(piece.get("index", 0), {"function": {"name": "", "arguments": ""}})
        for key in ("id", "type"):
            if piece.get(key):
                call[key] = piece[key]
        function = piece.get("function") or {}
        for key in ("name", "arguments"):
            call["function"][key] += function.get(key) or ""


def _add_logprobs(got: dict[str, Any], logprobs: Any) -> None:
    if not isinstance(logprobs, dict):
        return
    if "content" in logprobs:  # chat: one list
        got.setdefault("logprobs", []).extend(logprobs["content"] or ())
        return
    columns = got.setdefault("logprobs", {})  # completions: columns (text_offset as each server counts)
    for key, value in logprobs.items():
        columns.setdefault(key, []).extend(value or ())


def normalized(value: Any) -> Any:
    """``value`` without what legitimately differs between two servers (the module docstring)."""
    if isinstance(value, dict):
        return {k: normalized(v) for k, v in value.items() if k not in VOLATILE and v is not None}
    if isinstance(value, list):
        return [normalized(item) for item in value]
    if isinstance(value, str) and _TOOL_CALL_ID.match(value):
        return "<tool call id>"
    return value


def differences(direct: Answer, through: Answer) -> list[str]:
    """Each path where the two answers differ, with both values; empty when the client could not tell."""
    if direct.status >= 400 or through.status >= 400:
        if (direct.status, direct.error_param) == (through.status, through.error_param):
            return []
        return [
            f"status/param: vllm {direct.status} {direct.error_param!r}, phasegate {through.status} "
            f"{through.error_param!r} ({_error_text(through)})"
        ]
    found: list[str] = []
    _diff(normalized(direct.body), normalized(through.body), "", found)
    return found


def _diff(a: Any, b: Any, path: str, found: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in b:
                found.append(f"{path}.{key}: only vllm has it ({json.dumps(a[key])[:120]})")
            elif key not in a:
                found.append(f"{path}.{key}: only phasegate has it ({json.dumps(b[key])[:120]})")
            else:
                _diff(a[key], b[key], f"{path}.{key}", found)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            found.append(f"{path}: {len(a)} items from vllm, {len(b)} from phasegate")
        for index, (x, y) in enumerate(zip(a, b, strict=False)):
            _diff(x, y, f"{path}[{index}]", found)
    elif a != b:
        found.append(f"{path}: vllm {json.dumps(a)[:120]}, phasegate {json.dumps(b)[:120]}")


def _error_text(answer: Answer) -> str:
    error = answer.body.get("error") if isinstance(answer.body, dict) else None
    return str((error or {}).get("message", answer.body))[:200]
