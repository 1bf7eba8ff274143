"""A generation request's answer, as the driver's outputs come: a stream or a whole body.

A streamed answer goes out as SSE events whose ids are delta indexes; each content
delta counts as delivered once its send returned while the client was still there
(as far as the server noticed). A whole answer is collected, committed with its
completion in one durable append, and sent once. If the log fails mid-answer the
stream ends with the final error ``event_log_unavailable`` (docs/design.md §6).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.api.chat.shape import ChatShape, completion_id
from app.api.errors import failure_body, retry_headers
from app.api.json_answer import JSONAnswer
from app.api.messages.shape import MessagesShape
from app.api.pooling.answer import pooled_answer
from app.api.responses.shape import ResponsesShape
from app.api.shape import ChoiceAnswer, Shape
from app.api.token_stream import Leaving, Refused, client_gone, still_cancelled
from app.driver import log_loss
from app.driver.driver import RequestDriver
from app.driver.interruptions import CANCELLED_BY_CLIENT
from app.driver.outputs import Cancelled, Delta, Failed, Finished, Output, Restarted
from app.driver.request import GenerationRequest
from app.http.cycle import ChunkWriter
from app.store.errors import StoreError
from statemachine.deltas import TOOL_CALLS

log = logging.getLogger("phasegate.api")

T = TypeVar("T")


def shape_for(request: GenerationRequest, request_id: str, created: int, model: str | None = None) -> Shape:
    """The answer's shape for the API the client called: a Responses API answer, an
    Anthropic message, or a chat completion or completion."""
    if request.anthropic is not None:
        return MessagesShape(request, request_id, created, model)
    if request.responses is not None:
        return ResponsesShape(request, request_id, created, model)
    return ChatShape(request, completion_id(request, request_id), created, model)


async def whole_answer(driver: RequestDriver, output: Output) -> Output | JSONResponse:
    if driver.request.pooling is not None:  # no deltas: the replica's answer, whole
        return await pooled_answer(driver, output)
    deltas: dict[int, list[Delta]] = {}
    while not isinstance(output, Finished):
        if isinstance(output, Failed | Cancelled):
            return output
        if isinstance(output, Delta):
            deltas.setdefault(output.choice, []).append(output)
        elif isinstance(output, Restarted):
            deltas.clear()  # the failed attempt's text never reached the client
        output = await anext(driver.outputs)
    await driver.commit(flush=False)  # durable with the completion: the body goes out after both
    answers = [ChoiceAnswer() for _ in output.finish_reasons]
    for choice in sorted(deltas):
        for delta in deltas[choice]:
            driver.delivered(delta)
            answers[choice].add(
                delta.key, delta.text, delta.logprobs, delta.token_ids, delta.prompt, delta.prompt_logprobs
            )
    for choice, calls in sorted(output.tool_calls.items()):  # the calls a replica sent whole
        called = Delta(json.dumps(calls), choice, 0, key=TOOL_CALLS)
        driver.delivered(called)
        answers[choice].add(TOOL_CALLS, called.text, None)
    await driver.complete(output)
    shape = shape_for(driver.request, driver.request_id, driver.created, driver.answered_by)
    body = shape.completion(answers, output.finish_reasons, output.full_usage, output.stop_reasons)
    return JSONAnswer(body)


class _Stream:
    """What a streamed answer sent so far, shared by its body (``stream_body``) and the
    request loop, which writes a delta itself while the body waits caught up (``push``,
    from the loop's task or from an upstream connection's callback: app/driver/feed.py)."""

    def __init__(
        self,
        driver: RequestDriver,
        shape: Shape,
        gone: asyncio.Future[None],
        start: int,
        writer: ChunkWriter | None,
    ) -> None:
        self.driver = driver
        self.shape = shape
        self.gone = gone
        self.event_id = start  # the next event's id: its delta's index
        self.started = start > 0  # a content event went out
        if start == 0:
            shape.from_the_start()  # each chat choice's first delta after its role
        self.delivered_tokens = 0
        self.write_now = None if writer is None else writer.write_now

    def events(self, deltas: list[Delta]) -> bytes:
        """The content events of ``deltas`` (a choice's first after its role), in one write."""
        shape = self.shape
        if shape.unopened is None and len(deltas) == 1:  # the per-token path
            return _content_event(shape, self.event_id, deltas[0])
        events = []
        for n, d in enumerate(deltas, start=self.event_id):
            events.append(shape.opening(d.choice, d.prompt, d.prompt_tokens))
            events.append(_content_event(shape, n, d))
        return b"".join(events)

    def sent(self, deltas: list[Delta]) -> None:
        """``deltas`` were written to the client, which is still there: recorded delivered."""
        self.started = True
        for delta in deltas:
            self.driver.delivered(delta, index=self.event_id)
            self.event_id += 1
            self.delivered_tokens += delta.tokens

    def push(self, deltas: list[Delta]) -> int:
        """``deltas`` written and recorded delivered now, in the loop's step (or the
        upstream connection's callback), as far as nothing asks for the body's own path:
        the log behind (it waits), the client gone or the instance's lease lapsed (it
        ends), a socket that would block (it waits for it). How many, from the first: in
        one write, or one a delivery batch, as the body writes them (``behind`` is asked
        again after each write that may close a batch)."""
        write_now, driver = self.write_now, self.driver
        if write_now is None or self.gone.done() or driver.ctx.lease_lapsed():
            return 0
        recorder, pushed, count = driver.recorder, 0, len(deltas)
        while pushed < count and not recorder.behind:
            most = 1 if count - pushed == 1 else recorder.deliveries_before_a_batch_closes()  # (always >= 1)
            batch = deltas[pushed : pushed + most]
            if not write_now(self.events(batch)):
                break
            self.sent(batch)
            pushed += len(batch)
        return pushed


async def stream_body(
    driver: RequestDriver,
    shape: Shape,
    output: Output,
    gone: asyncio.Future[None],
    charge: Callable[[int], None],
    start: int = 0,
    writer: ChunkWriter | None = None,
    committed: Callable[[], Awaitable[None]] | None = None,
) -> AsyncIterator[bytes]:
    """The SSE events of a streamed answer, from delta ``start`` (a resumed client's);
    ``charge`` takes the tokens the client was sent (the tenant's tokens per minute) when
    it ends, however it ends. With the server's ``writer`` (``CHUNK_WRITER``) the loop's
    task writes each delta that comes while this body waits caught up (``_Stream.push``).
    ``committed`` (:func:`until_committed`) waits for a commit point begun before the
    response, ahead of the first events."""
    client = driver.outputs  # this client's reading end; a resumed client gets another
    stream = _Stream(driver, shape, gone, start, writer)
    try:
        if committed is not None:
            await committed()
        while True:
            if type(output) is Delta:
                recorder = driver.recorder
                if recorder.behind:  # two batches on their way to the log: let it catch up
                    await recorder.until_the_log_moves()
                # with the deltas the loop already has, in one write (up to the one that may
                # close a batch of the log, after which ``behind`` is asked again)
                deltas = [output, *client.ready_deltas(recorder.deliveries_before_a_batch_closes() - 1)]
                if driver.ctx.lease_lapsed():
                    # this instance's lease lapsed after the loop read them: they never go
                    # out, and the end that follows counts them undelivered (docs/design.md §11)
                    output = await anext(client)
                    continue
                yield stream.events(deltas)
                if gone.done():  # its send returned, but the server had lost the client (``client_gone``)
                    driver.client_gone()
                    return
                stream.sent(deltas)
                client.direct = stream.push  # the response has started: the loop may write
            elif isinstance(output, Finished):
                event_id = stream.event_id
                for choice, calls in sorted(output.tool_calls.items()):
                    yield shape.tool_calls_event(event_id, calls, choice)
                    driver.delivered(Delta(json.dumps(calls), choice, 0, key=TOOL_CALLS), index=event_id)
                    event_id = stream.event_id = event_id + 1
                await driver.complete(output)
                yield shape.ending(event_id, output.finish_reasons, output.stop_reasons, output.full_usage)
                return
            elif isinstance(output, Failed):
                yield shape.failure_event(stream.event_id, failure_body(driver.request_id, output))
                return
            elif isinstance(output, Cancelled):
                if output.reason == CANCELLED_BY_CLIENT:  # a stop button: whoever still reads is told
                    cancelled = Failed(
                        "request_cancelled",
                        "the client cancelled the request",
                        stream.started,
                        stream.delivered_tokens,
                        False,
                        499,
                    )
                    yield shape.failure_event(stream.event_id, failure_body(driver.request_id, cancelled))
                return
            output = await anext(client)
    except StopAsyncIteration:  # another client attached in its place
        return
    except StoreError:
        # Nothing more of this request can be recorded, so nothing more is sent: the
        # final error of docs/design.md §6; the request is closed in the log when it is back.
        log.error("request %s: the event log failed mid-answer; the stream ends", driver.request_id)
        driver.log_lost(output_delivered=stream.delivered_tokens > 0 or stream.started)
        failed = log_loss.failure(stream.delivered_tokens)
        yield shape.failure_event(stream.event_id, failure_body(driver.request_id, failed))
    except (asyncio.CancelledError, GeneratorExit):
        driver.client_gone()
        raise
    finally:
        client.direct = None
        charge(stream.delivered_tokens)


async def until_committed(driver: RequestDriver, committing: asyncio.Future[None], headers: dict[str, str]) -> None:
    """Wait for the commit point begun before the response was made ready
    (``RequestDriver.begin_commit``); a log that could not take it refuses the stream
    with 503 and nothing delivered (:class:`Refused`), as if it had never begun."""
    try:
        await asyncio.shield(committing)  # a client that leaves cancels the wait, not the append
    except StoreError:
        raise Refused(log_unavailable(driver, headers)) from None


def log_unavailable(driver: RequestDriver, headers: dict[str, str]) -> Response:
    """The answer to a request whose log failed before anything was delivered: 503, and
    the request ended in the log that way once it is back."""
    log.error("request %s refused: the event log is unavailable", driver.request_id)
    driver.log_lost(output_delivered=False)
    return failure_response(driver.request_id, log_loss.failure(0), headers)


async def unless_client_leaves(request: Request, driver: RequestDriver, work: Awaitable[T]) -> T | None:
    """Run ``work`` in this task; if the client disconnects first, cancel it and tell the driver."""
    leaving = Leaving(client_gone(request.scope, request.receive))
    try:
        result = await work
    except asyncio.CancelledError:
        if not leaving.stop() or still_cancelled():
            raise
        driver.client_gone()
        return None
    leaving.stop()  # a client gone now finds the response's own watch resolved at its start
    return result


def failure_response(request_id: str, failed: Failed, headers: dict[str, str]) -> Response:
    headers = headers | retry_headers(failed.retryable)
    return JSONResponse(failure_body(request_id, failed), status_code=failed.http_status, headers=headers)


def _content_event(shape: Shape, event_id: int, d: Delta) -> bytes:
    """The content event of delta ``d``, numbered ``event_id``: everything the delta says, passed on."""
    return shape.content_event(
        event_id,
        d.text,
        d.choice,
        key=d.key,
        logprobs=d.logprobs,
        token_ids=d.token_ids,
        prompt=d.prompt,
        tokens=d.tokens,
        prompt_tokens=d.prompt_tokens,
    )
