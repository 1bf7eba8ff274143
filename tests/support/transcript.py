"""What a client received, exactly: a raw SSE reader and the per-request checks.

A :class:`Transcript` (``ops/transcript.py``) keeps every SSE event of one streamed
request, the content deltas in order, the final error event if any and whether
``[DONE]`` arrived. :func:`check_request` then compares it with the
request's events in the log, the way docs/design.md §10 asks: what the client got
against what the log says was delivered, and the log's own invariants
(``statemachine.invariants``: no gap, no splice, one terminal event, attempts that
never overlapped, a replay without divergence).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx

from app.api.resume.log import deltas_of
from ops.transcript import Transcript
from statemachine import events as ev
from statemachine.deltas import TOOL_CALLS
from statemachine.events import ReleaseReason
from statemachine.invariants import violations
from statemachine.request_state import RequestState
from statemachine.state import fold


def stream_chat(
    base_url: str,
    body: dict[str, Any],
    *,
    on_delta: Callable[[int], object] | None = None,
    timeout: float = 60.0,
) -> Transcript:
    """POST a streamed chat and read it to the end. ``on_delta(n)`` runs after the n-th
    content delta; when it returns ``True`` the client hangs up there."""
    body = {**body, "stream": True}
    with (
        httpx.Client(base_url=base_url, timeout=timeout) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        transcript = Transcript(response.headers.get("x-request-id", ""), response.status_code)
        if response.status_code != 200:
            transcript.error = json.loads(response.read())["error"]
            return transcript
        for line in response.iter_lines():
            grew = transcript.read(line)
            if grew and on_delta is not None and on_delta(len(transcript.contents)) is True:
                break  # leaving the block closes the connection: the client is gone
    return transcript


def resume_stream(url: str, request_id: str, last_event_id: int | None = None, **headers: str) -> Transcript:
    """GET the request's stream again (docs/design.md §12), after ``last_event_id`` (None: from
    the start), and read it to its end; a refusal's error is in ``error``."""
    if last_event_id is not None:
        headers["last-event-id"] = str(last_event_id)
    transcript = Transcript(request_id, 0)
    with (
        httpx.Client(base_url=url, timeout=60) as http,
        http.stream("GET", f"/v1/requests/{request_id}/stream", headers=headers) as response,
    ):
        transcript.status = response.status_code
        if response.status_code != 200:
            transcript.error = response.read() and response.json()["error"]
            return transcript
        for line in response.iter_lines():
            transcript.read(line)
    return transcript


def of(events: list[ev.Event], cls: type[ev.Event]) -> list[ev.Event]:
    """The events of type ``cls``, in log order."""
    return [e for e in events if isinstance(e, cls)]


def check_request(events: list[ev.Event], transcript: Transcript | None = None, *, left: bool = False) -> RequestState:
    """The invariants every request must keep, whatever failed; returns its final state.

    ``left``: the client hung up mid-stream. The gateway may have written a few more deltas
    into the socket before it saw the client go, which the client never read: the log's
    deliveries then begin with exactly what the client read."""
    assert violations(events) == []
    state = fold(events)
    if transcript is not None:
        delivered = "".join(  # the text deltas (a tool-call delta's JSON is not text)
            delta.text
            for e in events
            if isinstance(e, ev.DeltasDelivered)
            for delta in deltas_of(e)
            if delta.key != TOOL_CALLS
        )
        if left:
            assert delivered.startswith(transcript.text), "the log's deliveries do not begin with the client's"
        else:
            assert transcript.text == delivered, "the client got something else than the log says it delivered"
        assert transcript.event_ids == list(range(len(transcript.event_ids))), "SSE ids skip or repeat"
        if left:
            assert len(transcript.contents) <= state.delivered_deltas, "the client read more than the log says"
        elif not transcript.tool_calls:  # (a choice's tool calls are one more delta of no tokens)
            assert len(transcript.contents) == state.delivered_deltas, "the client's deltas are not the log's"
        if transcript.error is not None and transcript.status == 200:
            # the final error says what the log says: its code, and tokens (deltas can hold several)
            assert transcript.error["code"] == state.error_code
            assert transcript.error["delivered_output_tokens"] == state.delivered_output_tokens
            assert transcript.error["partial_output"] is state.first_delta_sent
    return state


def released_by(events: list[ev.Event], attempt: int) -> ReleaseReason | None:
    for event in events:
        if isinstance(event, ev.AttemptReleased) and event.attempt == attempt:
            return event.because
    return None
