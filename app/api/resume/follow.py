"""Following a request's log to its end (docs/design.md §12): the one reader of an answer from
the log, for every API.

How this works: the follower rebuilds the deltas the log holds through the request's
shape, in the API its client called (app/api/shape.py), reading the log again every
``FOLLOW_EVERY_S`` while the request is live: its deliveries reach the log while it
streams (within a delivery batch and a group commit), so there is no seam between the log
and a live tail to get wrong, and the follower never appends to a live request. At the
terminal event it sends what the last attempt produced with no client attached, then the
ending (the finish, or the error the request ended with), and records what it sent as
``StreamResumed``, bookkeeping after the terminal event (expected-version guarded).

A chat stream's event ids are its delta indexes: it is read from the delta after the
reader's (``shape.after``). A numbered stream (the Responses and Messages APIs) is read
from its first delta, its shape leaving out the events its reader has.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from app.api.errors import LogUnavailable, failure_body
from app.api.resume.log import LoggedDelta, deltas_of, failure_of, produced_tail
from app.api.shape import Shape
from app.driver.context import GatewayContext
from app.driver.outputs import full_usage
from app.store.errors import StoreError, StoreUnavailable, StreamConflict
from statemachine import events as ev
from statemachine.deltas import TOOL_CALLS
from statemachine.request_state import RequestState
from statemachine.state import advance, fold

log = logging.getLogger("phasegate.api")

FOLLOW_EVERY_S = 0.02  # how often a live request's log is read again


class Follower:
    """Reads a request's log, and follows it to its end."""

    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx

    async def read(self, request_id: str) -> list[ev.Event]:
        try:
            return await self.ctx.store.read(request_id)
        except StoreUnavailable:
            raise LogUnavailable() from None

    async def follow(self, request_id: str, events: list[ev.Event], shape: Shape) -> AsyncIterator[bytes]:
        """The request's events after its reader's (``shape.after``) from the log, reading
        on while the request is live, then the ending."""
        first = 0 if shape.numbered else shape.after + 1  # the first delta index to send
        position = first  # the next delta index to send
        seen = 0  # events of the log taken into account
        if position == 0:
            shape.from_the_start()  # each chat choice's first delta after its role
        while True:
            for event in events[seen:]:
                seen += 1
                if isinstance(event, ev.DeltasDelivered):
                    for delta in deltas_of(event):
                        if delta.index >= position:
                            yield shape.opening(delta.choice, delta.prompt, delta.prompt_tokens) + delta_event(
                                shape, delta
                            )
                            position = delta.index + 1
                        else:  # where the next tokens start in its text, and the usage so far
                            text = "" if delta.key == TOOL_CALLS else delta.text
                            shape.passed(text, delta.choice, delta.tokens, delta.prompt_tokens)
                elif isinstance(event, ev.TERMINAL_EVENTS):
                    state = fold(events[:seen])
                    # then what the last attempt produced with no client attached (docs/design.md §12)
                    for delta in produced_tail(events[:seen], state):
                        if delta.index >= position:
                            yield shape.opening(delta.choice, delta.prompt, delta.prompt_tokens) + delta_event(
                                shape, delta
                            )
                            position = delta.index + 1
                    yield ending(shape, request_id, events[:seen], state)
                    await record_resumed(self.ctx, request_id, first, max(position, first))
                    return
            await asyncio.sleep(FOLLOW_EVERY_S)
            try:
                events = await self.ctx.store.read(request_id)
            except StoreUnavailable:
                continue  # the log is away: the follower waits for it


def delta_event(shape: Shape, delta: LoggedDelta) -> bytes:
    """The delta's events, as they were sent."""
    logprobs = delta.logprobs
    if shape.request.logprobs is None or (delta.key == TOOL_CALLS and not delta.tokens):
        logprobs = None  # (a choice's whole tool calls, or the rest of a chunk: none of their own)
    elif logprobs is None:
        logprobs = ()  # asked for, and not in the log (an older one): an empty list, as OpenAI's shape wants
    return shape.content_event(
        delta.index,
        delta.text,
        delta.choice,
        key=delta.key,
        logprobs=logprobs,
        token_ids=delta.token_ids,
        prompt=delta.prompt,
        tokens=delta.tokens,
        prompt_tokens=delta.prompt_tokens,
    )


def ending(shape: Shape, request_id: str, events: list[ev.Event], state: RequestState) -> bytes:
    """What followed the deltas (``events`` end with the terminal one): the finish, or the
    final error."""
    terminal = events[-1]
    next_id = max(state.delivered_deltas, state.produced_deltas)
    if isinstance(terminal, ev.RequestCompleted):
        reasons = terminal.finish_reasons or (terminal.finish_reason,) * max(state.n, 1)
        usage = full_usage(terminal.usage, terminal.usage_details)
        return shape.ending(next_id, reasons, terminal.stop_reasons, usage)
    return shape.failure_event(next_id, failure_body(request_id, failure_of(terminal, state, events)))


def shown_tokens(events: list[ev.Event], state: RequestState, to_index: int) -> int:
    """The output tokens of deltas ``[0, to_index)``: those delivered live, then those of the
    produced tail a reader of the ended request gets (0 where it had fewer than the live
    deliveries: the count stands at those)."""
    if to_index < state.delivered_deltas:
        return 0
    delivered = sum(e.tokens for e in events if isinstance(e, ev.DeltasDelivered))
    return delivered + sum(d.tokens for d in produced_tail(events, state) if d.index < to_index)


async def record_resumed(ctx: GatewayContext, request_id: str, from_index: int, to_index: int) -> None:
    """``StreamResumed`` after the terminal event: what a read from the log sent."""
    for _ in range(3):  # another resumer, or the owner's late bookkeeping, may append first
        try:
            events = await ctx.store.read(request_id)
            state = fold(events)
            to_index = min(to_index, max(state.delivered_deltas, state.produced_deltas))
            _, resumed = advance(  # stamped no earlier than the log's last event, whatever our clock says
                state,
                ev.StreamResumed,
                ctx.wall_clock(),
                from_index=min(from_index, to_index),
                to_index=to_index,
                gateway=ctx.gateway_id,
                tokens=shown_tokens(events, state, to_index),
            )
            await ctx.store.append(request_id, state.seq, [resumed], durable=True)
            log.debug("request %s: resumed deltas %d..%d sent", request_id, resumed.from_index, to_index - 1)
            return
        except StreamConflict:
            continue
        except StoreError as exc:
            log.warning("request %s: the resume was not recorded: %s", request_id, exc)
            return
