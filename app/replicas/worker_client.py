"""The gateway's client for the worker protocol (docs/worker-protocol.md).

``WorkerClient.start`` returns :class:`AttemptFrames` (attempt_frames.py), the attempt's
typed frames, from a request sent as attempt_start.py says (on connections of our own to
a plain ``http://`` worker); ``renew``, ``cancel`` and ``health`` are plain calls on
httpx. Every failure is a :class:`WorkerError`; the tree of them, each with the failure
kind it maps onto, opens ``worker_errors.py``.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from app.contract import worker_protocol
from app.replicas.attempt_frames import AttemptFrames
from app.replicas.attempt_start import AttemptStarts
from app.replicas.upstream_wire import json_body
from app.replicas.worker_errors import (
    ControlUnanswered,
    LeaseLost,
    ReplicaExiting,
    RequestRefused,
    StreamBroken,
    TokenRefused,
    WorkerError,
    error_fields,
    transport_error,
)

log = logging.getLogger(__name__)

# What a connection closed or reset under a call raises (see WorkerClient._control)
_BROKEN_UNDER_A_CALL = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)

# --- answers to the control calls ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LeaseRenewed:
    lease_epoch: int
    lease_ttl_ms: int
    phase: str


@dataclass(frozen=True, slots=True)
class CancelAck:
    """The worker's answer to a cancel, sent once the engine confirmed the abort.

    ``state``: ``aborted`` (stopped now, or earlier for ``stop``), ``finished`` (it had
    completed) or ``never_started`` (unknown here; a late start will be refused).
    """

    state: str
    generated_tokens: int
    stop: str | None


@dataclass(frozen=True, slots=True)
class Health:
    healthy: bool
    status: int
    code: str | None
    details: dict[str, Any]


# --- the client --------------------------------------------------------------------------


_ssl_context: ssl.SSLContext | None = None


def http_client(**kwargs: Any) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` for workers, with one TLS context per process.

    httpx builds a TLS context (parsing the CA bundle: docs/performance.md) for every client;
    a gateway that makes clients as replicas come and go should not pay that each time.
    """
    global _ssl_context
    if _ssl_context is None:
        _ssl_context = ssl.create_default_context()
    return httpx.AsyncClient(verify=_ssl_context, **kwargs)


class WorkerClient:
    """Talks to one worker at ``base_url``; share one ``httpx.AsyncClient`` across workers
    (the starts to a plain ``http://`` worker go on connections of this client's own)."""

    def __init__(
        self,
        base_url: str,
        *,
        http: httpx.AsyncClient | None = None,
        connect_timeout: float = 2.0,
        read_timeout: float | None = 5.0,
        control_timeout: float = 10.0,
        token: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # the protocol's version and its shared secret (docs/worker-protocol.md), on every call
        self._headers = {worker_protocol.HEADER: str(worker_protocol.VERSION)}
        if token is not None:
            self._headers["authorization"] = f"Bearer {token}"
        self._own_http = http is None
        self._http = http or http_client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.control_timeout = control_timeout
        self._starts = AttemptStarts(
            self.base_url,
            self._http,
            headers=self._headers,
            connect_timeout=connect_timeout,
            write_timeout=control_timeout,
        )

    @property
    def lean_starts(self) -> bool:
        """Whether attempts start on the lean connections (app/replicas/attempt_start.py), not httpx."""
        return self._starts.lean

    async def aclose(self) -> None:
        self._starts.close()
        if self._own_http:
            await self._http.aclose()

    async def start(
        self,
        *,
        request_id: str,
        attempt: int,
        lease_epoch: int,
        lease_ttl_s: float,
        model: str,
        messages: Sequence[Mapping[str, Any]] | None = None,
        prompt: str | list[Any] | None = None,
        params: Mapping[str, Any] | None = None,
        vllm: Mapping[str, Any] | None = None,
        heartbeat_s: float | None = None,
        read_timeout: float | None = None,
        pooling: str | None = None,
        prompt_logprobs: int | None = None,
    ) -> AttemptFrames:
        """Start an attempt; return its frames once the worker accepted it.

        A refusal raises before any frame: :class:`Rejected`, :class:`ReplicaExiting` or
        :class:`RequestRefused`. ``read_timeout`` bounds each wait for the next frame
        (heartbeats come every ``heartbeat_s`` while queued or in prefill); the client's
        own ``read_timeout`` when not given, and no bound here where that is ``None``
        (a caller that times its reads itself, as the gateway's stall timer does).
        ``params`` are the sampling fields every engine reads; ``vllm`` the client's fields
        as vLLM's server takes them, for a vLLM engine (docs/worker-protocol.md); ``pooling``
        a pooling request's route, its input in ``vllm`` (docs/design.md §17); ``prompt_logprobs``
        the prompt's log probabilities the answer carries (a ``prompt_logprobs`` frame each choice).
        """
        body: dict[str, Any] = {
            "request_id": request_id,
            "attempt": attempt,
            "lease_epoch": lease_epoch,
            "lease_ttl_ms": round(lease_ttl_s * 1000),
            "model": model,
        }
        if messages is not None:
            body["messages"] = list(messages)
        if prompt is not None:
            body["prompt"] = prompt
        if params:
            body["params"] = dict(params)
        if vllm is not None:
            body["vllm"] = dict(vllm)
        if pooling is not None:
            body["pooling"] = pooling
        if prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs
        if heartbeat_s is not None:
            body["heartbeat_ms"] = round(heartbeat_s * 1000)
        return await self._starts.start(body, self.read_timeout if read_timeout is None else read_timeout)

    async def _control(self, path: str, body: Mapping[str, Any], timeout: float | None) -> httpx.Response:
        """POST a control call. One whose connection broke under it is sent once more, on
        another connection: a kept-alive connection can be closed or reset under a request,
        and every control call may be sent twice (a renew extends the same lease, a cancel
        is answered as the first one was: docs/worker-protocol.md). Without this one broken
        connection read as the replica's exit (:class:`StreamBroken`)."""
        limit = self.control_timeout if timeout is None else timeout
        try:
            try:
                response = await self._post(path, body, limit)
            except _BROKEN_UNDER_A_CALL as exc:
                log.info("%s to %s: the connection broke (%r); sending it once more", path, self.base_url, exc)
                response = await self._post(path, body, limit)
        except httpx.ConnectError as exc:
            raise transport_error(exc) from exc
        except httpx.TimeoutException as exc:
            if isinstance(exc, httpx.ConnectTimeout):
                raise transport_error(exc) from exc
            raise ControlUnanswered(f"{path}: no answer within {limit} s") from exc
        except httpx.HTTPError as exc:
            raise StreamBroken(f"{path}: the connection broke: {exc!r}") from exc
        if response.status_code == 401:
            # the worker read nothing of the call: not a lost lease, not an acknowledgement
            code, message, _ = error_fields(response.content)
            raise TokenRefused(f"{path}: {message}", status=401, code=code)
        return response

    async def _post(self, path: str, body: Mapping[str, Any], limit: float) -> httpx.Response:
        timeout = httpx.Timeout(limit, connect=self.connect_timeout)
        return await self._http.post(self.base_url + path, json=body, headers=self._headers, timeout=timeout)

    async def renew(
        self,
        request_id: str,
        attempt: int,
        lease_epoch: int,
        lease_ttl_s: float,
        *,
        timeout: float | None = None,
    ) -> LeaseRenewed:
        """Extend the lease by ``lease_ttl_s`` from when the worker reads this; raises :class:`LeaseLost`."""
        body = {
            "request_id": request_id,
            "attempt": attempt,
            "lease_epoch": lease_epoch,
            "lease_ttl_ms": round(lease_ttl_s * 1000),
        }
        response = await self._control("/v1/attempts/renew", body, timeout)
        if response.status_code == 200:
            data = response.json()
            return LeaseRenewed(data["lease_epoch"], data["lease_ttl_ms"], data["phase"])
        code, message, _ = error_fields(response.content)
        if code == "replica_exiting":
            raise ReplicaExiting(message, status=response.status_code, code=code)
        raise LeaseLost(message, code=code or "unknown", status=response.status_code)

    async def renew_many(
        self, leases: Sequence[tuple[Any, ...]], *, timeout: float | None = None
    ) -> list[LeaseRenewed | WorkerError]:
        """Extend many leases (request id, attempt, epoch, TTL in seconds[, this renewal's
        number, the last answered one's]: app/worker/lease_calls.py) in one call: one answer
        each, in order, a refusal as a :class:`LeaseLost` (or :class:`ReplicaExiting`) value."""
        body = {"leases": [_lease(*lease) for lease in leases]}
        response = await self._control("/v1/leases/renew", body, timeout)
        if response.status_code != 200:
            code, message, field = error_fields(response.content)
            raise RequestRefused(message, status=response.status_code, code=code, field=field)
        answers: list[LeaseRenewed | WorkerError] = []
        for data in response.json()["leases"]:
            error = data.get("error")
            if error is None:
                answers.append(LeaseRenewed(data["lease_epoch"], data["lease_ttl_ms"], data["phase"]))
            elif error["code"] == "replica_exiting":
                answers.append(ReplicaExiting(error["message"], status=data["status"], code=error["code"]))
            else:
                answers.append(LeaseLost(error["message"], code=error["code"], status=data["status"]))
        return answers

    async def cancel(
        self, request_id: str, attempt: int, lease_epoch: int, *, timeout: float | None = None
    ) -> CancelAck:
        """Cancel an attempt; the answer comes only after the engine confirmed the abort."""
        body = {"request_id": request_id, "attempt": attempt, "lease_epoch": lease_epoch}
        response = await self._control("/v1/attempts/cancel", body, timeout)
        if response.status_code == 200:
            data = response.json()
            return CancelAck(data["state"], data["generated_tokens"], data["stop"])
        code, message, field = error_fields(response.content)
        if response.status_code >= 500:  # 504 abort_unconfirmed above all: the outcome is unknown
            raise ControlUnanswered(message, status=response.status_code, code=code)
        raise RequestRefused(message, status=response.status_code, code=code, field=field)

    async def health(self, *, timeout: float | None = None) -> Health:
        """The worker's health (a real one-token generation, cached briefly by the worker)."""
        limit = self.control_timeout if timeout is None else timeout
        try:
            response = await self._http.get(
                self.base_url + "/v1/health",
                headers=self._headers,
                timeout=httpx.Timeout(limit, connect=self.connect_timeout),
            )
        except httpx.HTTPError as exc:
            raise transport_error(exc) from exc
        try:
            body = response.json()
        except ValueError:
            body = {}
        code = (body.get("error") or {}).get("code") if isinstance(body, dict) else None
        return Health(response.status_code == 200, response.status_code, code, body)

    async def ready(self) -> bool:
        """Whether the worker accepts attempts now (engine loaded, not draining)."""
        try:
            response = await self._http.get(
                self.base_url + "/v1/ready", headers=self._headers, timeout=self.connect_timeout
            )
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def utility(self, path: str, body: dict[str, Any] | None) -> tuple[int, Any]:
        """``/v1/tokenize``, ``/v1/detokenize`` (POSTed ``body``) or ``/v1/version`` (a GET)."""
        url, timeout = f"{self.base_url}/v1/{path}", self.control_timeout
        if body is None:
            response = await self._http.get(url, headers=self._headers, timeout=timeout)
        else:
            headers = {**self._headers, "content-type": "application/json"}  # the body at any depth admitted
            response = await self._http.post(url, content=json_body(body), headers=headers, timeout=timeout)
        return response.status_code, response.json()

    async def info(self) -> dict[str, Any]:
        response = await self._http.get(self.base_url + "/v1/info", headers=self._headers, timeout=self.control_timeout)
        if response.status_code == 401:
            code, message, _ = error_fields(response.content)
            raise TokenRefused(message, status=401, code=code)
        result: dict[str, Any] = response.json()
        return result


def _lease(
    request_id: str, attempt: int, epoch: int, ttl: float, renewal: int | None = None, answered: int | None = None
) -> dict[str, Any]:
    lease: dict[str, Any] = {
        "request_id": request_id,
        "attempt": attempt,
        "lease_epoch": epoch,
        "lease_ttl_ms": round(ttl * 1000),
    }
    if renewal is not None:
        lease |= {"renewal": renewal, "answered": answered}
    return lease
