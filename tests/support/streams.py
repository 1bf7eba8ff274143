"""Reading attempt streams and a worker's admin endpoints, for tests."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from app.replicas.attempt_frames import AttemptFrames
from app.replicas.base import Done, Frame, Heartbeat, Token, ToolCallFrame
from app.replicas.worker_client import http_client
from app.replicas.worker_errors import WorkerError


@dataclass
class Collected:
    """What a stream delivered: frames with arrival times (s since ``t0``) and the error that ended it."""

    frames: list[Frame] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    error: WorkerError | None = None

    @property
    def tokens(self) -> list[Token]:
        return [f for f in self.frames if isinstance(f, Token)]

    @property
    def token_times(self) -> list[float]:
        return [t for f, t in zip(self.frames, self.times, strict=True) if isinstance(f, Token)]

    @property
    def heartbeats(self) -> list[Heartbeat]:
        return [f for f in self.frames if isinstance(f, Heartbeat)]

    @property
    def tool_calls(self) -> list[ToolCallFrame]:
        return [f for f in self.frames if isinstance(f, ToolCallFrame)]

    @property
    def done(self) -> Done | None:
        last = self.frames[-1] if self.frames else None
        return last if isinstance(last, Done) else None

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)

    @property
    def token_ids(self) -> list[int]:
        return [i for t in self.tokens for i in t.token_ids]


async def collect(
    stream: AttemptFrames,
    *,
    t0: float | None = None,
    max_frames: int | None = None,
    tokens: int | None = None,
    for_s: float | None = None,
) -> Collected:
    """Read frames until the stream ends, fails, ``max_frames`` were read, ``tokens`` token
    frames were (however many heartbeats came first: a loaded machine's prefill sends more),
    or ``for_s`` passed."""
    t0 = time.monotonic() if t0 is None else t0
    out = Collected()
    try:
        async for frame in stream:
            out.frames.append(frame)
            out.times.append(time.monotonic() - t0)
            if max_frames is not None and len(out.frames) >= max_frames:
                break
            if tokens is not None and len(out.tokens) >= tokens:
                break
            if for_s is not None and time.monotonic() - t0 >= for_s:
                break
    except WorkerError as exc:
        out.error = exc
    return out


async def worker_view(base_url: str) -> dict[str, Any]:
    """The worker's own view (GET /admin/attempts): its ``attempts`` and the engine's running
    requests (``engine_requests``)."""
    async with http_client() as http:
        view: dict[str, Any] = (await http.get(base_url + "/admin/attempts")).json()
    return view


async def attempt_state(base_url: str, request_id: str, attempt: int = 1) -> dict[str, Any]:
    """The worker's own view of one attempt (GET /admin/attempts)."""
    for state in (await worker_view(base_url))["attempts"]:
        if state["request_id"] == request_id and state["attempt"] == attempt:
            return dict(state)
    raise LookupError(f"no attempt {attempt} of {request_id} on {base_url}")


async def add_fault(base_url: str, **fault: Any) -> dict[str, Any]:
    """Register one scripted fault (POST /admin/faults); the worker must run with --enable-faults."""
    async with http_client() as http:
        response = await http.post(base_url + "/admin/faults", json=fault)
    response.raise_for_status()
    added: dict[str, Any] = response.json()["added"][0]
    return added


async def metric(base_url: str, name: str) -> float:
    """The sum of a metric's samples on /metrics (0 when absent)."""
    async with http_client() as http:
        text = (await http.get(base_url + "/metrics")).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total
