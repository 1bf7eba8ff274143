"""The Messages API's answer (docs/design.md §17): its stream of events, and the message,
built from the same driver outputs as a chat completion's.

Every event is a function of the deltas the client was sent, in order, and carries an SSE
``id:`` that phasegate adds: its number, counted from ``message_start`` (0). So the same
deltas give the same events with the same ids, and a client that resumes with
``Last-Event-ID: N`` is sent the events after N (``after``), rebuilt from the log on any
instance (app/api/messages/routes.py).

A delta's key says its content block: content goes into a ``text`` block, reasoning into a
``thinking`` block, tool calls into ``tool_use`` blocks (a piece with a call's id opens one,
its arguments' pieces are ``input_json_delta``); a change of kind closes the open block
(``content_block_stop``) and opens the next. Then ``message_delta`` with the stop reason and
the usage, and ``message_stop``. Nothing is sent before the first delta but
``message_start``, which goes out with it. A failure after it ends the stream with an
``error`` event in Anthropic's shape whose ``error`` also carries the fields of
docs/design.md §6. A thinking block's ``signature`` is empty: phasegate signs nothing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import orjson

from app.api.shape import ChoiceAnswer, Shape
from app.driver.request import GenerationRequest
from statemachine.deltas import CONTENT, REASONING_FIELDS, TOOL_CALLS

TEXT = "text"
THINKING = "thinking"
TOOL_USE = "tool_use"
# an error's HTTP status as Anthropic names its kind
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "api_error",
}


def message_id(request_id: str) -> str:
    """The message's id, from the gateway's request id."""
    return "msg_" + request_id.removeprefix("req_")


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error(status: int, error: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-shaped error object (app/api/errors.py) in Anthropic's shape: its ``type``
    is Anthropic's kind; phasegate's fields (``code``, ``param``, ``request_id``, and after
    a failure those of docs/design.md §6) stay beside it."""
    fields = {key: value for key, value in error.items() if key != "type"}
    return {"type": "error", "error": {"type": error_type(status), **fields}}


def messages_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """A chat completion's usage in this API's names: the input less what the prefix cache read."""
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    said: dict[str, Any] = {"input_tokens": max(0, usage.get("prompt_tokens", 0) - (cached or 0))}
    if cached is not None:
        said["cache_read_input_tokens"] = cached
    said["output_tokens"] = usage.get("completion_tokens", 0)
    return said


def stop_reason(
    finish_reason: str, reason: str | int | None, *, tool_used: bool, tool_complete: bool
) -> tuple[str | None, str | None]:
    """A chat finish as Anthropic's ``stop_reason`` and ``stop_sequence``, as vLLM maps it."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(reason, str):
        return "stop_sequence", reason
    return ("tool_use" if finish_reason == "tool_calls" or tool_used else "end_turn"), None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class MessagesShape(Shape):
    """Builds one message's stream events and its whole body."""

    numbered = True  # its events' ids

    def __init__(self, request: GenerationRequest, request_id: str, created: int, model: str | None = None) -> None:
        self.request = request
        self.response_id = message_id(request_id)
        self.created = created
        self.model = model or request.model
        self.sequence = 0  # the next event's id
        self.after = -1  # events numbered up to this one are not sent (a stream resumed)
        self.started = False  # message_start went out
        self.blocks = 0  # content blocks opened
        self.open: str | None = None  # the open block's kind
        self.calling: int | None = None  # the open tool_use block's call index
        self.arguments: list[str] = []  # the last tool call's arguments, as they came
        self.tool_used = False

    # --- the whole message ---------------------------------------------------------------

    def completion(
        self,
        answers: Sequence[ChoiceAnswer],
        finish_reasons: Sequence[str],
        usage: dict[str, Any],
        stop_reasons: Sequence[str | int | None] = (),
    ) -> dict[str, Any]:
        """The whole message (``stream: false``), as vLLM builds it: the thinking, the text,
        each only when it has any, then the tool calls; one empty text block for none."""
        answer = answers[0]
        content: list[dict[str, Any]] = []
        reasoning = "".join(piece for key in sorted(REASONING_FIELDS) for piece in answer.texts.get(key, ()))
        if reasoning:
            content.append({"type": THINKING, "thinking": reasoning, "signature": ""})
        text = "".join(answer.texts.get(CONTENT, ()))
        if text:
            content.append({"type": TEXT, "text": text})
        for call in answer.tool_calls:
            function = call.get("function") or {}
            arguments = function.get("arguments") or "{}"
            parsed = json.loads(arguments) if _is_json(arguments) else {}
            content.append({"type": TOOL_USE, "id": call.get("id"), "name": function.get("name"), "input": parsed})
        reason, sequence = stop_reason(
            finish_reasons[0],
            stop_reasons[0] if stop_reasons else None,
            tool_used=bool(answer.tool_calls),
            tool_complete=bool(answer.tool_calls),
        )
        return {
            **self._message(content or [{"type": TEXT, "text": ""}]),
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": messages_usage(usage),
        }

    def _message(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.response_id, "type": "message", "role": "assistant", "content": content, "model": self.model}

    # --- the stream ----------------------------------------------------------------------

    def _event(self, kind: str, body: dict[str, Any]) -> bytes:
        number = self.sequence
        self.sequence += 1
        if number <= self.after:
            return b""
        data = orjson.dumps({"type": kind, **body})
        return b"id: %d\nevent: %s\ndata: %s\n\n" % (number, kind.encode(), data)

    def _start(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        message = {
            **self._message([]),
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return [self._event("message_start", {"message": message})]

    def _open(self, block: dict[str, Any]) -> list[bytes]:
        events = self._close()
        self.open = block["type"]
        index = self.blocks
        self.blocks += 1
        return [*events, self._event("content_block_start", {"index": index, "content_block": block})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = self.calling = None
        return [self._event("content_block_stop", {"index": self.blocks - 1})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return self._event("content_block_delta", {"index": self.blocks - 1, "delta": delta})

    def content_event(
        self,
        event_id: int,
        text: str,
        choice: int = 0,
        *,
        key: str = CONTENT,
        logprobs: Any = None,  # (log probabilities, token ids, prompt fields: not in this API)
        token_ids: Any = (),
        prompt: Any = None,
        tokens: int = 1,  # (the usage so far: not in this API's events)
        prompt_tokens: int | None = None,
    ) -> bytes:
        """The events of one delta: its text's ``content_block_delta``, after the events
        that close the open block and open the delta's own when its kind changes."""
        if key == TOOL_CALLS:
            return self.tool_calls_event(event_id, orjson.loads(text), choice)
        events = self._start()
        kind = TEXT if key == CONTENT else THINKING if key in REASONING_FIELDS else None
        if kind is None or not text:  # no text (a token the parser kept back): no block
            return b"".join(events)
        if self.open != kind:
            events += self._open(
                {"type": TEXT, "text": ""} if kind == TEXT else {"type": THINKING, "thinking": "", "signature": ""}
            )
        if kind == TEXT:
            events.append(self._delta({"type": "text_delta", "text": text}))
        else:
            events.append(self._delta({"type": "thinking_delta", "thinking": text}))
        return b"".join(events)

    def tool_calls_event(self, event_id: int, calls: list[dict[str, Any]], choice: int = 0) -> bytes:
        """A delta of tool calls, as the chat delta's ``tool_calls`` carry them: a piece
        with a new call's index opens a ``tool_use`` block, its arguments' pieces are
        ``input_json_delta`` events (a call sent whole: all of them in one)."""
        events = self._start()
        for place, call in enumerate(calls):
            index = call.get("index", place)
            function = call.get("function") or {}
            if self.calling != index:
                block: dict[str, Any] = {
                    "type": TOOL_USE,
                    "id": call.get("id"),
                    "name": function.get("name"),
                    "input": {},
                }
                events += self._open(block)
                self.calling, self.tool_used, self.arguments = index, True, []
            arguments = function.get("arguments")
            if arguments:
                self.arguments.append(arguments)
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return b"".join(events)

    def ending(
        self,
        event_id: int,
        finish_reasons: Sequence[str],
        stop_reasons: Sequence[str | int | None],
        usage: dict[str, Any],
    ) -> bytes:
        """The open block closed, then ``message_delta`` (the stop reason, the usage) and ``message_stop``."""
        events = self._start() + self._close()
        reason, sequence = stop_reason(
            finish_reasons[0],
            stop_reasons[0] if stop_reasons else None,
            tool_used=self.tool_used,
            tool_complete=self.tool_used and _is_json("".join(self.arguments)),
        )
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        events.append(self._event("message_delta", {"delta": delta, "usage": messages_usage(usage)}))
        events.append(self._event("message_stop", {}))
        return b"".join(events)

    def failure_event(self, event_id: int, body: dict[str, Any]) -> bytes:
        """The stream's end after a failure (docs/design.md §6): an ``error`` event whose
        error carries the failure's fields."""
        events = self._start()
        error = body["error"]
        status = 500 if error.get("type") == "server_error" else 400
        events.append(self._event("error", {"error": anthropic_error(status, error)["error"]}))
        return b"".join(events)
