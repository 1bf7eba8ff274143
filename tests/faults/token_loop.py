"""What the token-loop fault tests share (docs/design.md §10): every failure kind at every point
of the token loop, for both replica kinds, one test module a kind of fault:

- ``test_token_loop_prefill``: 1. death in prefill, 2. death after token k was computed
  and before its event was written;
- ``test_token_loop_overload``: 6. an overloaded replica;
- ``test_token_loop_decode``: 3. death right after delta k reached the client;
- ``test_token_loop_cut``: 4. a network cut at token k;
- ``test_token_loop_tools``: 5. death after a tool call was emitted;
- ``test_token_loop_leave``: 7. the client leaving at token k.

Each case scripts one fault on the replicas (whichever takes the first attempt
misbehaves), streams one request through a real gateway with a raw SSE client, and
judges by what the client received and by the log (``check_request``): no
duplicate, gap or splice; one terminal event; attempts that never overlapped; a
replay without divergence; and the scenario's own expectations. The gateways are
the fixtures ``loop_gateway`` and ``slow_gateway`` (tests/faults/conftest.py).
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from app.config import Timeouts
from statemachine import events as ev
from statemachine.request_state import RequestState
from tests.support.gateway import MODEL, RunningGateway
from tests.support.scripted_upstream import running_scripted_upstream
from tests.support.transcript import Transcript, check_request, of, stream_chat

if TYPE_CHECKING:  # the fixtures in conftest use this module's timeouts
    from tests.faults.conftest import Evidence, Fleet

N = 8  # token indices 0…N
LONG = 200  # tokens: 30 s on the slow fleet, an answer that outlasts any lag of the client before a cut
INDICES = list(range(N + 1))
# Generous: no timer fires on a loaded machine unless the case makes it. A module whose
# case waits for one sets its own TIMEOUTS, short where the case waits (the gateway
# fixtures read the module's, tests/faults/conftest.py).
TIMEOUTS = Timeouts(
    stall_s=10.0,
    lease_ttl_s=10.0,
    cancel_ack_s=10.0,
    first_token_soft_s=10.0,
    first_token_hard_s=30.0,
    upstream_response_s=30.0,
)


def body(prompt: str, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "seed": 3, **extra}


def prompt_for(name: str) -> str:
    return f"{name} {uuid.uuid4().hex[:10]}"


def settle(
    gateway: RunningGateway, transcript: Transcript, evidence: Evidence, *, left: bool = False
) -> tuple[list[ev.Event], RequestState]:
    events = gateway.events(transcript.request_id)
    inputs = gateway.call(gateway.gateway.ctx.store.read_input(transcript.request_id))
    evidence.keep(transcript.request_id, events, transcript, inputs and inputs.body)
    return events, check_request(events, transcript, left=left)


def replicas_of(events: list[ev.Event]) -> list[str]:
    return [e.replica_id for e in of(events, ev.AttemptStarted)]  # type: ignore[attr-defined]


def reference(gateway: RunningGateway, fleet: Fleet, prompt: str) -> str:
    """What a healthy replica answers to ``prompt`` (every replica answers the same), asked
    once the faults scripted for it are dropped: one armed on a replica the faulted request
    never reached would meet this request instead (a died replica not back yet: ci)."""
    fleet.clear_faults()
    return stream_chat(gateway.url, body(prompt)).text


def tokens_of(answer: str, count: int) -> Iterator[str]:
    """The first ``count`` deltas of ``answer`` as the replicas cut it (a leading space per word)."""
    words = answer.split(" ")
    pieces = (
        [" " + w for w in words[1:]] if answer.startswith(" ") else [words[0] + " ", *[w + " " for w in words[1:-1]]]
    )
    return iter(pieces[:count])


def leave_once_accepted(gateway: RunningGateway, request: dict[str, object], timeout: float = 30.0) -> str:
    """POST ``request`` as a streamed chat and hang up as soon as the gateway accepted it
    (its driver runs), before any header came back; the request's id. Waiting for the
    acceptance, not a moment: a loaded gateway may not have read the request yet."""
    payload = json.dumps({**request, "stream": True}).encode()
    head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    head += f"content-length: {len(payload)}\r\n\r\n"
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    drivers, deadline = gateway.gateway.ctx.drivers, time.monotonic() + timeout
    with socket.create_connection((host, int(port)), timeout) as sock:
        sock.sendall(head.encode() + payload)
        while not drivers:
            assert time.monotonic() < deadline, f"the gateway did not accept the request within {timeout:g} s"
            time.sleep(0.005)
        (request_id,) = list(drivers)
    return request_id


@contextlib.contextmanager
def tool_webhook() -> Iterator[tuple[str, Callable[[], dict[str, int]]]]:
    """A real webhook process that counts tool executions per idempotency key."""
    with running_scripted_upstream() as hook:
        yield hook.base_url + "/tools/execute", lambda: hook.tool_runs
