"""Starting an attempt on a worker: ``POST /v1/attempts``, whose answer is the attempt's frames.

How this works: a plain ``http://`` worker gets the request on connections of our own
(app/replicas/upstream_http.py, as an OpenAI upstream's completions do), its fixed
header lines encoded once and its body by orjson; each read of the answer is bounded
by the read timeout (the head's by ``head_timeout_s``, the body's by
:class:`ReadsWithin`), which raise httpx's ``ReadTimeout``, as httpx's own read timeout
did. A worker behind TLS or a proxy gets the request through httpx. Either way the body
goes to :class:`AttemptFrames` as :class:`BodyReads`, and the failures are httpx's
exception classes, so one mapping (``transport_error``) and one refusal reading serve
both. The held stream is what this is about: httpx carried each one through h11, its
pool and several async generators and a cancel scope a chunk (``ops/bench/overhead.py``
measures the memory a held stream costs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from app.replicas.attempt_frames import AttemptFrames
from app.replicas.body_reads import BodyReads, HttpxBody, ReadsWithin, read_all
from app.replicas.upstream_http import Answer, lean_connections
from app.replicas.upstream_wire import header_line, json_body, retry_after_seconds
from app.replicas.worker_errors import (
    Rejected,
    ReplicaExiting,
    RequestRefused,
    TokenRefused,
    WorkerError,
    error_fields,
    transport_error,
)
from app.telemetry.tracing import trace_headers


class AttemptStarts:
    """The start requests to one worker; ``http`` carries them where the lean connections cannot."""

    def __init__(
        self,
        base_url: str,
        http: httpx.AsyncClient,
        *,
        headers: Mapping[str, str],
        connect_timeout: float,
        write_timeout: float,
    ) -> None:
        self._http = http
        self._headers = headers
        self._connect_timeout = connect_timeout
        self._write_timeout = write_timeout
        self._url = httpx.URL(base_url + "/v1/attempts")
        self._target = self._url.raw_path
        self._connections = lean_connections(base_url, connect_timeout_s=connect_timeout)
        # an answer never compressed: its body is read as it comes
        fixed = {**headers, "content-type": "application/json", "accept-encoding": "identity"}
        self._header_lines = b"".join(header_line(name, value) for name, value in fixed.items())

    @property
    def lean(self) -> bool:
        """Whether the starts go on the lean connections (a plain ``http://`` worker, no proxy)."""
        return self._connections is not None

    def close(self) -> None:
        if self._connections is not None:
            self._connections.close()

    async def start(self, body: Mapping[str, Any], read_timeout: float | None) -> AttemptFrames:
        """Send the start; return its frames once the worker accepted it, or raise its
        refusal. ``read_timeout`` bounds each read (``None``: the caller bounds them)."""
        content = json_body(body)
        try:
            if self._connections is not None:
                lines = self._header_lines
                for name, value in trace_headers().items():  # httpx's request hook, for the lean path
                    lines += header_line(name, value)
                lean = await self._connections.post(self._target, lines, content, head_timeout_s=read_timeout)
                answer: Answer | httpx.Response = lean
                reads: BodyReads = lean.body if read_timeout is None else ReadsWithin(lean.body, read_timeout)
            else:
                answer, reads = await self._send_by_httpx(content, read_timeout)
        except httpx.HTTPError as exc:
            raise transport_error(exc) from exc
        if answer.status_code == 200:
            return AttemptFrames(reads, answer.headers.get("x-phasegate-worker"))
        try:
            refusal = await read_all(reads)
        except httpx.HTTPError as exc:
            raise transport_error(exc) from exc
        finally:
            await reads.aclose()
        raise _refused(answer.status_code, answer.headers.get("retry-after"), refusal)

    async def _send_by_httpx(self, content: bytes, read_timeout: float | None) -> tuple[httpx.Response, BodyReads]:
        timeout = httpx.Timeout(self._write_timeout, connect=self._connect_timeout, read=read_timeout)
        headers = {**self._headers, "content-type": "application/json"}
        request = self._http.build_request("POST", self._url, content=content, timeout=timeout, headers=headers)
        response = await self._http.send(request, stream=True)
        return response, HttpxBody(response)


def _refused(status: int, retry_after: str | None, content: bytes) -> WorkerError:
    """The error a start's refusal (an answer other than 200, before any frame) is."""
    code, message, field = error_fields(content)
    if status == 401:
        return TokenRefused(message, status=status, code=code)
    if code == "replica_exiting":
        return ReplicaExiting(message, status=status, code=code)
    if status == 429 or status >= 500:
        return Rejected(message, status=status, code=code, retry_after=retry_after_seconds(retry_after))
    return RequestRefused(message, status=status, code=code, field=field)
