"""What the token-loop fault tests share (DESIGN.md §10): every failure kind at every point
of the token loop, for both replica kinds, one test module a kind of fault:

- ``test_token_loop_prefill``: 1. death in prefill, 2. death after token k was computed
  and before its event was written, 6. an overloaded replica;
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
    from tests.faults.conftest import Evidence

N = 8  # token indices 0…N
INDICES = list(range(N + 1))
TIMEOUTS = Timeouts(
    stall_s=1.0,
    lease_ttl_s=1.0,
    cancel_ack_s=0.5,
    first_token_soft_s=0.3,
    first_token_hard_s=5.0,
    upstream_response_s=5.0,
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


def reference(gateway: RunningGateway, prompt: str) -> str:
    """What a healthy replica answers to ``prompt`` (every replica answers the same)."""
    return stream_chat(gateway.url, body(prompt)).text


def tokens_of(answer: str, count: int) -> Iterator[str]:
    """The first ``count`` deltas of ``answer`` as the replicas cut it (a leading space per word)."""
    words = answer.split(" ")
    pieces = (
        [" " + w for w in words[1:]] if answer.startswith(" ") else [words[0] + " ", *[w + " " for w in words[1:-1]]]
    )
    return iter(pieces[:count])


def only_request_id(gateway: RunningGateway) -> str:
    """The one request of this test's fresh database (for a client that never got headers)."""

    async def first_accepted() -> str:
        async for _, event in gateway.gateway.ctx.store.follow(0):
            if isinstance(event, ev.RequestAccepted):
                return event.request_id
        raise AssertionError("no request was accepted")

    return gateway.call(first_accepted(), timeout=10)


@contextlib.contextmanager
def tool_webhook() -> Iterator[tuple[str, Callable[[], dict[str, int]]]]:
    """A real webhook process that counts tool executions per idempotency key."""
    with running_scripted_upstream() as hook:
        yield hook.base_url + "/tools/execute", lambda: hook.tool_runs
