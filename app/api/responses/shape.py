"""The Responses API's answer (docs/design.md §15): its stream of numbered events, and the
response object, built from the same driver outputs as a chat completion's.

Every event is a function of the deltas the client was sent, in order: the
``sequence_number`` counts the events from ``response.created`` (0), and the item ids
(``msg_…``, ``rs_…``, ``fc_…``) are the response's id and the item's ``output_index``.
So the same deltas give the same events with the same numbers.

A delta's key says its item: content goes into a ``message`` item's ``output_text``
part, reasoning into a ``reasoning`` item's ``reasoning_text``; a change of key closes
the open item (its ``…done`` events) and opens the next. Tool calls come whole at the
end, as the driver has them (``Finished.tool_calls``): each a ``function_call`` item
with one arguments delta. Then ``response.completed`` with the whole response, its
status ``incomplete`` when ``max_output_tokens`` cut it (one event either way, as vLLM
sends it). A failure after the first delta ends the stream with ``response.failed``, its
``error`` carrying the fields of docs/design.md §6; nothing is sent before the first delta but
``response.created`` and ``response.in_progress``, which go out with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from app.api.responses.items import ID_PREFIX, MESSAGE, REASONING, Item, item_kind, logprobs_of
from app.api.shape import ChoiceAnswer, Shape
from app.contract import json_depth as deep_json
from app.driver.request import GenerationRequest
from statemachine.deltas import CONTENT, REASONING_FIELDS, TOOL_CALLS

CANCELLED_CODE = "request_cancelled"


def responses_id(request_id: str) -> str:
    """The response's id, from the gateway's request id."""
    return "resp_" + request_id.removeprefix("req_")


def responses_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """A chat completion's usage in this API's names."""
    prompt_details = usage.get("prompt_tokens_details") or {}
    completion_details = usage.get("completion_tokens_details") or {}
    # vLLM's details, with its per-turn lists (one turn: no tool runs inside a response here)
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "input_tokens_details": {
            "cached_tokens": prompt_details.get("cached_tokens") or 0,
            "cache_write_tokens": prompt_details.get("cache_write_tokens") or 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": usage.get("completion_tokens", 0),
        "output_tokens_details": {
            "reasoning_tokens": completion_details.get("reasoning_tokens") or 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": usage.get("total_tokens", usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)),
    }


class ResponsesShape(Shape):
    """Builds one response's stream events and its response object."""

    numbered = True  # its events' sequence_number

    def __init__(self, request: GenerationRequest, request_id: str, created: int, model: str | None = None) -> None:
        assert request.responses is not None
        self.request = request
        self.params = request.responses.echo
        self.response_id = responses_id(request_id)
        self.created = created
        self.model = model or request.model
        self.logprobs = request.responses.output_logprobs
        self.sequence = 0  # the next event's sequence_number
        self.after = -1  # events numbered up to this one are not sent (a stream read again)
        self.started = False  # response.created and response.in_progress went out
        self.items: list[Item | dict[str, Any]] = []  # the output: open or closed items, function calls
        self.open: Item | None = None
        self.calling: tuple[int, dict[str, Any]] | None = None  # the open function call: its index, its item

    # --- the response object -------------------------------------------------------------

    def response(
        self,
        status: str,
        *,
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        incomplete: str | None = None,
    ) -> dict[str, Any]:
        output = [
            item
            if isinstance(item, dict)
            else item.body(
                "in_progress" if item is self.open and status == "in_progress" else "completed", logprobs=self.logprobs
            )
            for item in self.items
        ]
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "output": output,
            "usage": None if usage is None else responses_usage(usage),
            "error": error,
            "incomplete_details": None if incomplete is None else {"reason": incomplete},
            **self.params,
        }

    def completion(
        self,
        answers: Sequence[ChoiceAnswer],
        finish_reasons: Sequence[str],
        usage: dict[str, Any],
        stop_reasons: Sequence[str | int | None] = (),
    ) -> dict[str, Any]:
        """The whole response (``stream: false``) from its one choice, as vLLM builds it:
        the reasoning and the message, each only when it has text, then the function calls."""
        answer = answers[0]
        reasoning = [piece for key in sorted(REASONING_FIELDS) for piece in answer.texts.get(key, ())]
        if reasoning:
            self._add(REASONING).pieces = reasoning
        content = answer.texts.get(CONTENT, [])
        if "".join(content):
            message = self._add(MESSAGE)
            message.pieces, message.logprobs = list(content), list(answer.logprobs)
        for call in answer.tool_calls:
            self.items.append(self._function_call(call))
        return self._final(finish_reasons[0], usage)

    def _add(self, kind: str) -> Item:
        item = Item(kind, self._item_id(kind))
        self.items.append(item)
        return item

    def _final(self, finish_reason: str, usage: dict[str, Any]) -> dict[str, Any]:
        if finish_reason == "length":
            return self.response("incomplete", usage=usage, incomplete="max_output_tokens")
        return self.response("completed", usage=usage)

    def _item_id(self, kind: str) -> str:
        return f"{ID_PREFIX[kind]}_{self.response_id.removeprefix('resp_')}_{len(self.items)}"

    def _function_call(self, call: dict[str, Any]) -> dict[str, Any]:
        function = call.get("function") or {}
        return {
            "id": self._item_id("function_call"),
            "type": "function_call",
            "call_id": call.get("id"),
            "name": function.get("name"),
            "arguments": function.get("arguments") or "",
            "status": "completed",
        }

    # --- the stream ----------------------------------------------------------------------

    def _event(self, kind: str, body: dict[str, Any]) -> bytes:
        number = self.sequence
        self.sequence += 1
        if number <= self.after:
            return b""
        event = {"type": kind, "sequence_number": number, **body}
        try:
            data = orjson.dumps(event)
        except TypeError:  # deeper than orjson writes: a response echoing a deep schema
            data = deep_json.dumps(event).encode()
        return b"event: %s\ndata: %s\n\n" % (kind.encode(), data)

    def _start(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        initial = self.response("in_progress")
        return [
            self._event("response.created", {"response": initial}),
            self._event("response.in_progress", {"response": initial}),
        ]

    def content_event(
        self,
        event_id: int,
        text: str,
        choice: int = 0,
        *,
        key: str = CONTENT,
        logprobs: Any = None,
        token_ids: Any = (),  # (vLLM's token ids and prompt fields: not in the Responses API)
        prompt: Any = None,
        tokens: int = 1,  # (the usage so far: not in this API's events)
        prompt_tokens: int | None = None,
    ) -> bytes:
        """The events of one delta: its text's delta event, after the events that close
        the open item and open the delta's own when its kind changes."""
        if key == TOOL_CALLS:
            return self.tool_calls_event(event_id, orjson.loads(text), choice)
        events = self._start()
        kind = item_kind(key)
        if kind is None:
            return b"".join(events)
        item = self.open
        if item is None or item.kind != kind:
            events += self._close()
            events += self._close_call()
            item = self.open = self._add(kind)
            events += self._opened(item)
        item.pieces.append(text)
        where = {"item_id": item.id, "output_index": len(self.items) - 1, "content_index": 0}
        if kind == REASONING:
            events.append(self._event("response.reasoning_text.delta", {**where, "delta": text}))
        else:
            entries = logprobs or ()
            item.logprobs.extend(entries)
            rendered = logprobs_of(entries, with_bytes=False) if self.logprobs else []
            events.append(self._event("response.output_text.delta", {**where, "delta": text, "logprobs": rendered}))
        return b"".join(events)

    def _opened(self, item: Item) -> list[bytes]:
        index = len(self.items) - 1
        empty = (
            {"type": "reasoning_text", "text": ""} if item.kind == REASONING else Item(MESSAGE, "").part(logprobs=False)
        )
        return [
            self._event(
                "response.output_item.added", {"output_index": index, "item": item.body("in_progress", logprobs=False)}
            ),
            self._event(
                "response.content_part.added",
                {"item_id": item.id, "output_index": index, "content_index": 0, "part": empty},
            ),
        ]

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        where = {"item_id": item.id, "output_index": index, "content_index": 0}
        done = "response.reasoning_text.done" if item.kind == REASONING else "response.output_text.done"
        text_done = {**where, "text": item.text}
        if item.kind == MESSAGE:
            text_done["logprobs"] = logprobs_of(item.logprobs, with_bytes=False) if self.logprobs else []
        return [
            self._event(done, text_done),
            self._event("response.content_part.done", {**where, "part": item.part(logprobs=self.logprobs)}),
            self._event(
                "response.output_item.done",
                {"output_index": index, "item": item.body("completed", logprobs=self.logprobs)},
            ),
        ]

    def tool_calls_event(self, event_id: int, calls: list[dict[str, Any]], choice: int = 0) -> bytes:
        """A delta of tool calls, as the chat delta's ``tool_calls`` carry them: each
        piece adds to the call its ``index`` names (a call whole: its place), a new one
        opened as a ``function_call`` item, its arguments' pieces as deltas; a call is
        done once the next item opens or the response ends."""
        events = self._start() + self._close()
        for place, call in enumerate(calls):
            index = call.get("index", place)
            function = call.get("function") or {}
            if self.calling is None or self.calling[0] != index:
                events += self._close_call()
                item = self._function_call(call)
                item["arguments"], item["status"] = "", "in_progress"
                self.calling = (index, item)
                self.items.append(item)
                events.append(
                    self._event("response.output_item.added", {"output_index": len(self.items) - 1, "item": {**item}})
                )
            item = self.calling[1]
            if "arguments" in function:  # a piece of them (a call sent whole: all, even none)
                item["arguments"] += function["arguments"] or ""
                where = {"item_id": item["id"], "output_index": self.items.index(item)}
                events.append(
                    self._event(
                        "response.function_call_arguments.delta", {**where, "delta": function["arguments"] or ""}
                    )
                )
        return b"".join(events)

    def _close_call(self) -> list[bytes]:
        if self.calling is None:
            return []
        item = self.calling[1]
        self.calling = None
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        return [
            self._event(
                "response.function_call_arguments.done", {**where, "name": item["name"], "arguments": item["arguments"]}
            ),
            self._event("response.output_item.done", {"output_index": where["output_index"], "item": item}),
        ]

    def ending(
        self,
        event_id: int,
        finish_reasons: Sequence[str],
        stop_reasons: Sequence[str | int | None],
        usage: dict[str, Any],
    ) -> bytes:
        """The open item closed, then ``response.completed`` with the whole response (its
        status ``incomplete`` when ``max_output_tokens`` cut it)."""
        events = self._start() + self._close() + self._close_call()
        # one event whatever the status, as vLLM sends it: the SDK's stream helper takes
        # its final response from ``response.completed`` alone
        events.append(self._event("response.completed", {"response": self._final(finish_reasons[0], usage)}))
        return b"".join(events)

    def failure_event(self, event_id: int, body: dict[str, Any]) -> bytes:
        """The stream's end after a failure (docs/design.md §6): ``response.failed``, whose
        error carries the failure's fields, and the output the client was sent."""
        events = self._start()
        return b"".join([*events, self._event("response.failed", {"response": self.failed_response(body["error"])})])

    def failed_response(self, error: dict[str, Any]) -> dict[str, Any]:
        """The response of a request that failed (or was cancelled) with ``error``, with
        the output it was sent; the item the failure cut is ``incomplete``."""
        status = "cancelled" if error.get("code") == CANCELLED_CODE else "failed"
        response = self.response(status, error=error)
        if self.open is not None:
            response["output"][self.items.index(self.open)]["status"] = "incomplete"
            self.open = None
        if self.calling is not None:
            response["output"][self.items.index(self.calling[1])]["status"] = "incomplete"
            self.calling = None
        return response
