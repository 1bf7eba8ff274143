"""A ``phasegate worker`` replica: the worker protocol's client behind ``ReplicaClient``.

The client's errors are already :class:`UpstreamFailure`\\ s naming their failure kind,
and its frames are the driver's. One refinement happens here, at the start of an
attempt: whatever stops the start request before the worker accepted it (connection
refused or timed out, 429, 503, the worker exiting) means nothing started, so it is
recorded as ``rejected`` and a retry elsewhere counts as a new-request migration
(docs/design.md §4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from http import HTTPStatus
from typing import Any

import httpx

from app.contract import worker_protocol
from app.replicas.attempt_frames import AttemptFrames
from app.replicas.base import AttemptRequest, ProbeAnswer, Renewal, Token, UpstreamFailure
from app.replicas.pooled import is_pooling
from app.replicas.worker_client import LeaseRenewed, WorkerClient
from app.replicas.worker_errors import ConnectTimedOut, LivenessUncertain, RequestRefused, WorkerError
from app.telemetry.tracing import inject_traceparent
from statemachine.events import FailureKind

# the client's fields a start request carries in fields of their own, not under ``vllm``
_SENT_APART = frozenset({"messages", "prompt"})
# where the client asked for the usage in every chunk: the worker reads it as vLLM's server
# does, and says each choice's prompt count with its first text (docs/worker-protocol.md)
_CONTINUOUS_USAGE = {"include_usage": True, "continuous_usage_stats": True}


def _fields(request: AttemptRequest, apart: frozenset[str]) -> dict[str, Any]:
    """The client's fields for the worker (its ``vllm``): those not sent apart, and, where the
    client asked for the usage in every chunk, the stream's options that say so (the client's
    own are phasegate's to set: app/contract/request_fields.py)."""
    fields = {name: value for name, value in request.passed.items() if name not in apart}
    if request.continuous_usage:
        fields["stream_options"] = _CONTINUOUS_USAGE
    return fields


class WorkerReplica:
    kind = "worker"
    acknowledges_cancel = True
    aborts_on_close = False  # its fence waits for the stronger proof: a cancel ack, or the lease
    sends_heartbeats = True

    def __init__(
        self, replica_id: str, base_url: str, *, connect_timeout_s: float = 2.0, token: str | None = None
    ) -> None:
        self.replica_id = replica_id
        self.reported_load: int | None = None
        self.incompatible: str | None = None
        self._http = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            event_hooks={"request": [inject_traceparent]},  # the request's trace, when tracing is on
        )
        # Reads are bounded by the driver's own stall timer (one timer an attempt, moved
        # only when it fires), not by the client (a timeout a read).
        self.client = WorkerClient(
            base_url,
            http=self._http,
            connect_timeout=connect_timeout_s,
            read_timeout=None,
            control_timeout=10.0,
            token=token,
        )

    async def start(self, request: AttemptRequest) -> _WorkerStream:
        pooling = request.endpoint if is_pooling(request.endpoint) else None
        apart = _SENT_APART if pooling is None else frozenset()  # a pooling request's messages are its input
        try:
            stream = await self.client.start(
                request_id=request.request_id,
                attempt=request.attempt,
                lease_epoch=request.lease_epoch,
                lease_ttl_s=request.lease_ttl_s,
                model=request.model,
                messages=request.messages,
                prompt=request.prompt,
                params=request.sampling,
                vllm=_fields(request, apart),
                pooling=pooling,
                prompt_logprobs=request.prompt_logprobs,
            )
        except RequestRefused:
            raise
        except WorkerError as error:
            if error.released or isinstance(error, ConnectTimedOut):  # the attempt never began
                raise UpstreamFailure(
                    FailureKind.REJECTED,
                    error.message,
                    status=error.status,
                    code=error.code,
                    retry_after_s=error.retry_after_s,
                ) from error
            raise
        return _WorkerStream(stream)

    async def renew_all(self, renewals: Sequence[Renewal]) -> list[bool]:
        leases = [(r.request_id, r.attempt, r.lease_epoch, r.lease_ttl_s, n, k) for r, n, k in renewals]
        try:
            answers = await self.client.renew_many(leases)
        except WorkerError as error:
            if error.kind is FailureKind.LIVENESS_UNCERTAIN:
                raise  # unanswered: the leases may still run
            return [False] * len(renewals)
        return [isinstance(answer, LeaseRenewed) for answer in answers]

    async def cancel(self, request_id: str, attempt: int, lease_epoch: int) -> int | None:
        ack = await self.client.cancel(request_id, attempt, lease_epoch)
        return ack.generated_tokens

    async def health(self) -> ProbeAnswer:
        try:
            health = await self.client.health()
        except LivenessUncertain:  # no connection or no answer within the timeout
            return ProbeAnswer.SILENT
        except WorkerError:
            return ProbeAnswer.UNHEALTHY
        running, queued = health.details.get("running"), health.details.get("queued")
        if type(running) is int and type(queued) is int:  # every gateway's attempts on it
            self.reported_load = running + queued
        if not health.healthy:
            return ProbeAnswer.UNHEALTHY
        self.incompatible = worker_protocol.incompatibility(health.details)
        return ProbeAnswer.HEALTHY if self.incompatible is None else ProbeAnswer.INCOMPATIBLE

    async def utility(self, path: str, body: dict[str, Any] | None) -> tuple[int, Any]:
        """The worker serves vLLM's utility routes under ``/v1/`` (docs/worker-protocol.md);
        its refusal is given in vLLM's error shape (``type`` the status's phrase, ``param``)."""
        status, answer = await self.client.utility(path, body)
        error = answer.get("error") if isinstance(answer, dict) else None
        if status >= 400 and isinstance(error, dict):
            kind = _error_type(status)
            answer = {
                "error": {
                    "message": error.get("message", ""),
                    "type": kind,
                    "param": error.get("field"),
                    "code": status,
                }
            }
        return status, answer

    async def model_cards(self) -> dict[str, dict[str, Any]]:
        try:
            info = await self.client.info()
        except (WorkerError, httpx.HTTPError, ValueError):
            return {}
        length, models, cards = info.get("max_model_len"), info.get("models"), info.get("model_cards")
        if type(length) is not int or not isinstance(models, list):
            return {}
        if not isinstance(cards, dict):  # a sim engine, or a worker of before the cards
            cards = {}
        return {
            name: card if isinstance(card := cards.get(name), dict) else {"max_model_len": length}
            for name in models
            if isinstance(name, str)
        }

    async def close(self) -> None:
        await self.client.aclose()  # its own connections, for the attempts' streams
        await self._http.aclose()


class _WorkerStream:
    unstreamed = False  # a worker's tokens come as they are made, a whole answer's too

    def __init__(self, stream: AttemptFrames) -> None:
        self._stream = stream

    def frames(self) -> AttemptFrames:
        return self._stream  # an async iterator of the driver's frames, raising UpstreamFailures

    def offer_tokens(self, take: Callable[[list[Token]], bool]) -> None:
        self._stream.offer_tokens(take)

    async def close(self) -> None:
        await self._stream.aclose()


def _error_type(status: int) -> str:
    """vLLM's error ``type`` for a request it refuses as invalid: the status's phrase."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"
