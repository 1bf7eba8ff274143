"""A replica that is any OpenAI-compatible server, such as ``vllm serve``.

Such a server knows nothing of leases: renewing is a no-op, and a cancel is only
the closed connection (vLLM aborts a request whose client went away) with no
acknowledgement. Before any delivery, closing the stream is therefore the fence
(``aborts_on_close``: an assumption, never proven); after one, a fence waits for the
gateway-side lease to run out. It sends nothing while it queues or prefills, so
before the first token its own first-token deadline applies (``openai_first_token_s``,
see ``AttemptRun.next_frame``).

Upstream behaviour mapped to the failure kinds of docs/design.md §4:

    connection refused / connect timeout          rejected (nothing started)
    429 (Retry-After honoured), 5xx before start  rejected
    4xx such as context_length_exceeded           request_refused, reason passed on
    no response headers within the deadline       liveness_uncertain
    connection reset / EOF mid-stream             replica_exited
    a malformed chunk                             liveness_uncertain (fence, then retry)
    an error object inside the stream             request_refused for a 4xx code (vLLM's own
                                                  checks of a started stream), else replica_exited
    every choice finished (and usage sent)        completes, without waiting for [DONE]

Every answer is streamed upstream but one whose client asked it whole with the prompt's log
probabilities (``AttemptRequest.prompt_logprobs``), which vLLM gives unstreamed only: that
one is asked ``stream: false`` and read as its stream's frames (app/replicas/openai_whole.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any, NoReturn

import httpx
import orjson

from app.contract.refusal_codes import code_for
from app.replicas.base import AttemptRequest, ProbeAnswer, Renewal, UpstreamFailure
from app.replicas.body_reads import BodyReads, HttpxBody, read_all
from app.replicas.chat_echo import chat_echo
from app.replicas.openai_stream import OpenAIStream
from app.replicas.openai_whole import WholeAnswerStream, WholeBody
from app.replicas.pooled import PooledStream, is_pooling
from app.replicas.upstream_http import Answer, lean_connections
from app.replicas.upstream_wire import header_line, json_body, retry_after_seconds
from app.telemetry.tracing import inject_traceparent, trace_headers
from statemachine.events import FailureKind


class OpenAIUpstream:
    acknowledges_cancel = False
    aborts_on_close = True  # vLLM aborts a request whose connection closed (no acknowledgement)
    sends_heartbeats = False
    kind = "openai"
    reported_load: int | None = None  # vLLM's running + waiting requests, from its /metrics (None: not vLLM)
    incompatible: str | None = None  # an OpenAI-compatible server has no protocol version to differ in

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
        self._header_lines = b"".join(header_line(name, value) for name, value in fixed.items() if name != "host")

    async def start(self, request: AttemptRequest) -> OpenAIStream | PooledStream | WholeAnswerStream:
        if is_pooling(request.endpoint):
            return await self._pool(request)
        chat = request.endpoint == "chat.completions"
        # vLLM names its own request after this header: its logs then say which attempt it is
        request_name = f"{request.request_id}.{request.attempt}"
        if request.prompt_logprobs is not None:  # vLLM gives them unstreamed only
            return self._whole(request, chat, request_name)
        content = _request_body(request, chat)
        async with self._answering():
            answer, body = await self._post(chat, request_name, content)
        if answer.status_code != 200:
            await _refused(answer, body)
        encoding = answer.headers.get("content-encoding", "identity")
        if encoding != "identity" and self._connections is not None:  # asked for none: a broken answer
            await body.aclose()
            raise UpstreamFailure(FailureKind.LIVENESS_UNCERTAIN, f"an answer encoded as {encoding!r}")
        echo = chat_echo(request.passed) if chat else ""
        return OpenAIStream(body, choices=request.choices, echo=echo, continuous=request.continuous_usage)

    async def _post(self, chat: bool, request_name: str, content: bytes) -> tuple[Answer | httpx.Response, BodyReads]:
        """Send a completion's body; its answer's head, and its body to read."""
        if self._connections is None:
            return await self._send_by_httpx(chat, request_name, content)
        lines = self._header_lines + header_line("x-request-id", request_name)
        for name, value in trace_headers().items():
            lines += header_line(name, value)
        target = self._chat_target if chat else self._completions_target
        lean = await self._connections.post(target, lines, content)
        return lean, lean.body

    def _whole(self, request: AttemptRequest, chat: bool, request_name: str) -> WholeAnswerStream:
        """The attempt asked unstreamed, sent at its stream's first read: its head comes once
        the answer is whole, which the driver's first-token deadline bounds (openai_whole.py)."""
        content = _request_body(request, chat, whole=True)

        async def answer() -> bytes:
            async with self._answering(deadline=False):
                answer, body = await self._post(chat, request_name, content)
            if answer.status_code != 200:
                await _refused(answer, body)
            try:
                return await read_all(body)
            finally:
                await body.aclose()

        return WholeAnswerStream(WholeBody(answer, chat=chat), request.choices)

    async def _pool(self, request: AttemptRequest) -> PooledStream:
        """A pooling request, on its route's path (docs/design.md §17): the client's body
        with the attempt's model; its answer is read whole by the stream."""
        content = json_body({**request.passed, "model": request.model})
        headers = {"x-request-id": f"{request.request_id}.{request.attempt}", "content-type": "application/json"}
        async with self._answering():
            sent = self._client.build_request("POST", request.endpoint, content=content, headers=headers)
            response = await self._client.send(sent, stream=True)
        if response.status_code != 200:
            await _refused(response, HttpxBody(response))
        return PooledStream(response)

    @contextlib.asynccontextmanager
    async def _answering(self, *, deadline: bool = True) -> AsyncIterator[None]:
        """The wait for an answer's status and headers, within the response deadline (an
        unstreamed answer's: the driver's, ``deadline`` False): what a failure to get them
        says of the replica (the table above)."""
        try:
            async with asyncio.timeout(self.response_timeout_s if deadline else None):
                yield
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise UpstreamFailure(FailureKind.REJECTED, f"cannot connect: {exc!r}") from None
        except TimeoutError:
            raise UpstreamFailure(
                FailureKind.LIVENESS_UNCERTAIN, f"no response within {self.response_timeout_s:g}s"
            ) from None
        except httpx.TransportError as exc:
            raise UpstreamFailure(FailureKind.REPLICA_EXITED, f"connection failed: {exc!r}") from None

    async def _send_by_httpx(self, chat: bool, request_name: str, content: bytes) -> tuple[httpx.Response, BodyReads]:
        headers = {"x-request-id": request_name, "content-type": "application/json"}
        url = self._chat_url if chat else self._completions_url
        http_request = self._client.build_request("POST", url, content=content, headers=headers)
        response = await self._client.send(http_request, stream=True)
        return response, HttpxBody(response)

    async def renew_all(self, renewals: Sequence[Renewal]) -> list[bool]:
        return [True] * len(renewals)  # no lease upstream; the gateway's lease is the bound a fence waits for

    async def cancel(self, request_id: str, attempt: int, lease_epoch: int) -> int | None:
        return None  # closing the stream is the only cancel; it is never acknowledged

    async def health(self) -> ProbeAnswer:
        """A real 1-token generation; a server that serves no generation (a pooling model's
        ``vllm serve``: no ``/v1/completions``, 404) answers its ``/health`` instead."""
        body = {"model": self.health_model, "prompt": "ping", "max_tokens": 1, "temperature": 0}
        try:
            response = await self._client.post("/v1/completions", json=body, timeout=self.response_timeout_s)
            if response.status_code == 404:
                response = await self._client.get("/health", timeout=self.response_timeout_s)
        except httpx.TimeoutException:
            return ProbeAnswer.SILENT
        except httpx.HTTPError:
            return ProbeAnswer.UNHEALTHY
        if response.status_code != 200:
            return ProbeAnswer.UNHEALTHY
        self.reported_load = await self._engine_load()
        return ProbeAnswer.HEALTHY

    async def model_cards(self) -> dict[str, dict[str, Any]]:
        try:
            response = await self._client.get("/v1/models", timeout=self.response_timeout_s)
            listed = response.json()["data"] if response.status_code == 200 else []
            return {card["id"]: card for card in listed if isinstance(card, dict) and isinstance(card.get("id"), str)}
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return {}

    async def utility(self, path: str, body: dict[str, Any] | None) -> tuple[int, Any]:
        """vLLM serves its utility routes at the root: ``/tokenize``, ``/detokenize``, ``/version``."""
        timeout = self.response_timeout_s
        if body is None:
            response = await self._client.get(f"/{path}", timeout=timeout)
        else:
            content, typed = json_body(body), {"content-type": "application/json"}  # at any depth admitted
            response = await self._client.post(f"/{path}", content=content, headers=typed, timeout=timeout)
        return response.status_code, response.json()

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


def _request_body(request: AttemptRequest, chat: bool, *, whole: bool = False) -> bytes:
    """The completion's JSON body: the client's fields as it sent them (a request of its
    own, such as a probe, gives its messages or prompt and sampling instead), streamed with
    its usage, which phasegate needs whatever the client asked (docs/compatibility.md), and
    with the usage so far in every chunk only where the client asked for that; ``whole``,
    unstreamed, as the client sent it (its echo too: vLLM's whole chat echo works)."""
    body: dict[str, Any] = dict(request.passed)
    if not body:
        body.update(request.sampling)
        if chat:
            body["messages"] = list(request.messages or ())
        else:
            body["prompt"] = request.prompt
    options = request.passed.get("stream_options")
    if whole:
        return json_body(body | {"model": request.model, "stream": False})
    if chat:  # the gateway sends a chat echo itself (app/replicas/chat_echo.py)
        body.pop("echo", None)
    body["model"] = request.model
    body["stream"] = True
    body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    if request.continuous_usage:
        body["stream_options"]["continuous_usage_stats"] = True
    return json_body(body)


async def _refused(answer: Answer | httpx.Response, body: BodyReads) -> NoReturn:
    """Raise the failure a non-200 answer means, once its body (the reason) is read."""
    try:
        whole = await read_all(body)
    except httpx.HTTPError:
        whole = b""
    finally:
        await body.aclose()
    raise _refusal(answer.status_code, answer.reason_phrase, answer.headers.get("retry-after"), whole)


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
            retry_after_s=retry_after_seconds(retry_after),
        )
    return UpstreamFailure(
        FailureKind.REQUEST_REFUSED, message, status=status, code=code or code_for(status, message), param=param
    )
