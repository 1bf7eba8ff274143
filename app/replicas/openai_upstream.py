"""A replica that is any OpenAI-compatible server, such as ``vllm serve``.

Such a server knows nothing of leases: renewing is a no-op, and a cancel is only
the closed connection (vLLM aborts a request whose client went away) with no
acknowledgement. Before any delivery, closing the stream is therefore the fence
(``aborts_on_close``: an assumption, never proven); after one, a fence waits for the
gateway-side lease to run out. It sends nothing while it queues or prefills, so
before the first token its own first-token deadline applies (``openai_first_token_s``,
see ``AttemptRun.next_frame``).

Upstream behaviour mapped to the failure kinds of DESIGN.md §4:

    connection refused / connect timeout          rejected (nothing started)
    429 (Retry-After honoured), 5xx before start  rejected
    4xx such as context_length_exceeded           request_refused, reason passed on
    no response headers within the deadline       liveness_uncertain
    connection reset / EOF mid-stream             replica_exited
    a malformed chunk                             liveness_uncertain (fence, then retry)
    an error object inside the stream             replica_exited
    every choice finished (and usage sent)        completes, without waiting for [DONE]
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import httpx
import orjson

from app.contract.logprobs import TokenLogprob, from_wire
from app.replicas.base import AttemptRequest, Done, Frame, ProbeAnswer, Token, ToolCall, UpstreamFailure
from app.replicas.upstream_http import Answer, lean_connections
from app.tracing import inject_traceparent, trace_headers
from statemachine.events import FINISH_REASONS, FailureKind

# After every choice finished, how long to wait for the usage chunk before completing
# without it: an upstream that never sends [DONE] must not hold the answer back.
USAGE_GRACE_S = 0.5


class OpenAIUpstream:
    acknowledges_cancel = False
    aborts_on_close = True  # vLLM aborts a request whose connection closed (no acknowledgement)
    sends_heartbeats = False
    kind = "openai"
    reported_load: int | None = None  # vLLM's running + waiting requests, from its /metrics (None: not vLLM)

    def __init__(
        self,
        replica_id: str,
        base_url: str,
        *,
        health_model: str,
        connect_timeout_s: float = 2.0,
        response_timeout_s: float = 10.0,
        api_key: str | None = None,
    ) -> None:
        self.replica_id = replica_id
        self.base_url = base_url.rstrip("/")
        self.health_model = health_model
        self.response_timeout_s = response_timeout_s
        # the streamed completions go through connections of our own where they can
        # (app/replicas/upstream_http.py); the probes and anything else through httpx
        self._connections = lean_connections(self.base_url, connect_timeout_s=connect_timeout_s)
        self._chat_url = httpx.URL(f"{self.base_url}/v1/chat/completions")
        self._completions_url = httpx.URL(f"{self.base_url}/v1/completions")
        self._chat_target, self._completions_target = self._chat_url.raw_path, self._completions_url.raw_path
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(connect=connect_timeout_s, read=None, write=10.0, pool=connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            event_hooks={"request": [inject_traceparent]},  # the request's trace, when tracing is on
        )
        # what the lean connections send on every request, encoded once: the client's own
        # headers, but an answer never compressed (its body is read as it comes)
        fixed = {**self._client.headers, "accept-encoding": "identity", "content-type": "application/json"}
        self._header_lines = b"".join(_header_line(name, value) for name, value in fixed.items() if name != "host")

    async def start(self, request: AttemptRequest) -> _OpenAIStream:
        chat = request.endpoint == "chat.completions"
        content = _request_body(request, chat)
        # vLLM names its own request after this header: its logs then say which attempt it is
        request_name = f"{request.request_id}.{request.attempt}"
        try:
            async with asyncio.timeout(self.response_timeout_s):
                if self._connections is not None:
                    lines = self._header_lines + _header_line("x-request-id", request_name)
                    for name, value in trace_headers().items():
                        lines += _header_line(name, value)
                    target = self._chat_target if chat else self._completions_target
                    lean = await self._connections.post(target, lines, content)
                    answer: Answer | httpx.Response = lean
                    body: _BodyReads = lean.body
                else:
                    answer, body = await self._send_by_httpx(chat, request_name, content)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise UpstreamFailure(FailureKind.REJECTED, f"cannot connect: {exc!r}") from None
        except TimeoutError:
            raise UpstreamFailure(
                FailureKind.LIVENESS_UNCERTAIN, f"no response within {self.response_timeout_s:g}s"
            ) from None
        except httpx.TransportError as exc:
            raise UpstreamFailure(FailureKind.REPLICA_EXITED, f"connection failed: {exc!r}") from None
        if answer.status_code != 200:
            try:
                whole = await _read_all(body)
            except httpx.HTTPError:
                whole = b""
            finally:
                await body.aclose()
            raise _refusal(answer.status_code, answer.reason_phrase, answer.headers.get("retry-after"), whole)
        encoding = answer.headers.get("content-encoding", "identity")
        if encoding != "identity" and self._connections is not None:  # asked for none: a broken answer
            await body.aclose()
            raise UpstreamFailure(FailureKind.LIVENESS_UNCERTAIN, f"an answer encoded as {encoding!r}")
        return _OpenAIStream(body, choices=int(request.sampling.get("n", 1)))

    async def _send_by_httpx(self, chat: bool, request_name: str, content: bytes) -> tuple[httpx.Response, _BodyReads]:
        headers = {"x-request-id": request_name, "content-type": "application/json"}
        url = self._chat_url if chat else self._completions_url
        http_request = self._client.build_request("POST", url, content=content, headers=headers)
        response = await self._client.send(http_request, stream=True)
        return response, _HttpxBody(response)

    async def renew_all(self, requests: Sequence[AttemptRequest]) -> list[bool]:
        return [True] * len(requests)  # no lease upstream; the gateway's lease is the bound a fence waits for

    async def cancel(self, request_id: str, attempt: int, lease_epoch: int) -> int | None:
        return None  # closing the stream is the only cancel; it is never acknowledged

    async def health(self) -> ProbeAnswer:
        """A real 1-token generation."""
        body = {"model": self.health_model, "prompt": "ping", "max_tokens": 1, "temperature": 0}
        try:
            response = await self._client.post("/v1/completions", json=body, timeout=self.response_timeout_s)
        except httpx.TimeoutException:
            return ProbeAnswer.SILENT
        except httpx.HTTPError:
            return ProbeAnswer.UNHEALTHY
        if response.status_code != 200:
            return ProbeAnswer.UNHEALTHY
        self.reported_load = await self._engine_load()
        return ProbeAnswer.HEALTHY

    async def _engine_load(self) -> int | None:
        """The requests vLLM holds, every client's (``vllm:num_requests_running`` and
        ``_waiting`` on its /metrics); ``None`` from a server that does not say."""
        try:
            response = await self._client.get("/metrics", timeout=self.response_timeout_s)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        counts = [float(m.group(1)) for m in _VLLM_LOAD.finditer(response.text)]
        return round(sum(counts)) if counts else None

    async def close(self) -> None:
        if self._connections is not None:
            self._connections.close()
        await self._client.aclose()


_VLLM_LOAD = re.compile(r"^vllm:num_requests_(?:running|waiting)(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


def _request_body(request: AttemptRequest, chat: bool) -> bytes:
    """The completion's JSON body, by orjson (httpx's ``json=`` took three times as long)."""
    body: dict[str, Any] = {
        "model": request.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        **request.sampling,
    }
    if chat:
        body["messages"] = list(request.messages or ())
    else:
        body["prompt"] = request.prompt
    try:
        return orjson.dumps(body)
    except TypeError:  # what orjson cannot write (an integer over 64 bits)
        return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _header_line(name: str, value: str) -> bytes:
    line = f"{name}: {value}\r\n".encode()
    if line.count(b"\n") != 1 or line.count(b"\r") != 1:  # a field must never end the head early
        raise ValueError(f"a line break in the header {name}")
    return line


class _BodyReads(Protocol):
    """An answer's body as :class:`_OpenAIStream` reads it: ``b""`` once it ended."""

    async def read(self) -> bytes: ...

    async def aclose(self) -> None: ...


class _HttpxBody:
    """An ``httpx.Response``'s body read as the lean connections' (TLS, a proxy)."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        encoded = response.headers.get("content-encoding", "identity") != "identity"
        self._reads = aiter(response.aiter_bytes() if encoded else response.aiter_raw())

    async def read(self) -> bytes:
        try:
            return await anext(self._reads)  # never empty before the end
        except StopAsyncIteration:
            return b""

    async def aclose(self) -> None:
        await self._response.aclose()


async def _read_all(body: _BodyReads) -> bytes:
    parts = []
    while part := await body.read():
        parts.append(part)
    return b"".join(parts)


def _refusal(status: int, reason: str, retry_after: str | None, body: bytes) -> UpstreamFailure:
    """The failure an upstream's non-200 answer means, with its reason passed on."""
    try:
        payload = orjson.loads(body)
    except ValueError:
        payload = {}
    error = payload.get("error", payload) if isinstance(payload, dict) else {}
    if not isinstance(error, dict):
        error = {"message": str(error)}
    message = str(error.get("message") or reason or "upstream error")
    code = error.get("code") if isinstance(error.get("code"), str) else None
    param = error.get("param") if isinstance(error.get("param"), str) else None
    if status == 429 or status >= 500:
        return UpstreamFailure(
            FailureKind.REJECTED,
            f"{status}: {message}",
            status=status,
            code=code,
            retry_after_s=_retry_after(retry_after),
        )
    return UpstreamFailure(
        FailureKind.REQUEST_REFUSED, message, status=status, code=code or _code_for(status, message), param=param
    )


def _retry_after(value: str | None) -> float | None:
    try:
        return max(float(value), 0.0) if value else None
    except ValueError:
        return None


def _code_for(status: int, message: str) -> str:
    if "maximum context length" in message or "context length" in message:
        return "context_length_exceeded"
    return {400: "upstream_bad_request", 404: "model_not_found", 413: "request_too_large"}.get(
        status, "upstream_refused_request"
    )


class _OpenAIStream:
    def __init__(self, body: _BodyReads, choices: int) -> None:
        self._body = body
        self._choices = choices

    async def frames(self) -> AsyncIterator[Frame]:
        finish_reasons: dict[int, str] = {}
        usage: dict[str, int] | None = None
        pending_calls: dict[tuple[int, int], dict[str, str]] = {}
        index = 0
        # Lines split here from the body's bytes, not by httpx's aiter_lines (three
        # generators a read, and str.splitlines, which also splits a JSON string at a raw
        # U+2028 or U+0085 that vLLM sends as it is): only CR and LF end an SSE line.
        body = self._body
        lines: list[bytes] = []  # complete lines not looked at yet, the next one last
        rest: bytes | None = b""  # a line whose end is not read yet; None once the body ended
        try:
            while True:
                finished = len(finish_reasons) >= self._choices
                if finished and usage is not None:
                    break  # everything is here: do not wait for [DONE]
                if not lines:
                    if rest is None:
                        break
                    try:
                        if finished:  # only the usage chunk may still come
                            async with asyncio.timeout(USAGE_GRACE_S):
                                read = await body.read()
                        else:
                            read = await body.read()
                    except TimeoutError:
                        break
                    if not read:  # the body ended; a last line without its line break
                        lines, rest = [rest.rstrip(b"\r")], None
                        continue
                    lines, rest = _split_lines(rest + read if rest else read)
                    continue
                line = lines.pop()
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments, event names
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = _parse_chunk(data)
                if isinstance(chunk.get("usage"), dict):
                    # counts the log can hold (bigint); anything else is left out
                    usage = {k: v for k, v in chunk["usage"].items() if type(v) is int and 0 <= v < 2**63}
                for choice in chunk.get("choices") or ():
                    number = choice.get("index", 0)
                    delta = choice.get("delta") or {}
                    text = delta.get("content") if "delta" in choice else choice.get("text")
                    if text:
                        logprobs = _logprobs(choice.get("logprobs"))
                        yield Token(number, index, text, (), logprobs)
                        index += 1
                    for call in delta.get("tool_calls") or ():
                        slot = pending_calls.setdefault(
                            (number, call.get("index", 0)), {"id": "", "name": "", "arguments": ""}
                        )
                        slot["id"] = slot["id"] or call.get("id") or ""
                        function = call.get("function") or {}
                        slot["name"] += function.get("name") or ""
                        slot["arguments"] += function.get("arguments") or ""
                    if choice.get("finish_reason"):
                        if choice["finish_reason"] not in FINISH_REASONS:  # the log could not hold it
                            raise UpstreamFailure(
                                FailureKind.LIVENESS_UNCERTAIN, f"unknown finish reason {choice['finish_reason']!r}"
                            )
                        finish_reasons[number] = choice["finish_reason"]
        except httpx.TransportError as exc:
            raise UpstreamFailure(FailureKind.REPLICA_EXITED, f"stream broken: {exc!r}") from None
        if len(finish_reasons) < self._choices:
            raise UpstreamFailure(FailureKind.REPLICA_EXITED, "the stream ended before every choice finished")
        for (number, call_index), call in sorted(pending_calls.items()):
            yield ToolCall(number, call_index, call["id"], call["name"], call["arguments"])
        reasons = [finish_reasons[number] for number in sorted(finish_reasons)]
        yield Done(reasons[0], reasons, usage or {})

    async def close(self) -> None:
        await self._body.aclose()


def _logprobs(given: Any) -> tuple[TokenLogprob, ...] | None:
    """A chunk's log probabilities (chat's ``content`` list, or the completions' columns)."""
    if given is None:
        return None
    try:
        if "content" in given:  # chat
            entries = [
                [e["token"], e["logprob"], [[t["token"], t["logprob"]] for t in e.get("top_logprobs") or ()]]
                for e in given["content"] or ()
            ]
        else:  # completions: tokens, token_logprobs, top_logprobs (one {token: logprob} a token)
            tops = given.get("top_logprobs") or [None] * len(given["tokens"])
            entries = [
                [token, logprob, [[t, lp] for t, lp in (top or {}).items()]]
                for token, logprob, top in zip(given["tokens"], given["token_logprobs"], tops, strict=True)
            ]
        return from_wire(entries)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UpstreamFailure(FailureKind.LIVENESS_UNCERTAIN, f"malformed logprobs in a chunk: {exc!r}") from None


def _split_lines(received: bytes) -> tuple[list[bytes], bytes]:
    """The complete lines of ``received`` (CRLF, LF or CR ended), the next one last, and
    the start of the line after them. A trailing CR is held back: it may be half a CRLF."""
    held = b""
    if received.endswith(b"\r"):
        received, held = received[:-1], b"\r"
    if b"\r" in received:
        received = received.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    *lines, rest = received.split(b"\n")
    lines.reverse()
    return lines, rest + held


_NO_CHOICES: list[Any] = []  # never changed: what a chunk without choices is checked as


def _parse_chunk(data: bytes | str) -> dict[str, Any]:
    try:
        # orjson, not json: it refuses what is not Unicode text (a lone UTF-16 surrogate
        # escape), which could neither be sent on as UTF-8 nor recorded, and NaN
        chunk = orjson.loads(data)
    except ValueError as exc:
        if isinstance(data, bytes):  # as text, as it was read before: bytes not UTF-8 replaced
            return _parse_chunk(data.decode("utf-8", "replace"))
        raise UpstreamFailure(FailureKind.LIVENESS_UNCERTAIN, f"malformed chunk ({exc}): {data[:80]!r}") from None
    if type(chunk) is not dict or type(chunk.get("choices", _NO_CHOICES)) is not list:  # orjson's own types
        raise UpstreamFailure(FailureKind.LIVENESS_UNCERTAIN, f"malformed chunk: {data[:80]!r}")
    if "error" in chunk:
        error = chunk["error"]
        message = error.get("message") if isinstance(error, dict) else str(error)
        raise UpstreamFailure(FailureKind.REPLICA_EXITED, f"upstream error mid-stream: {message}")
    return chunk
