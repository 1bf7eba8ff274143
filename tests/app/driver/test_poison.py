"""Poison requests over real sim workers: a request that got a server error twice before any
output ends with ``poison_request`` (not retryable), and ejects no replica (docs/design.md §13).

Judged by what the real ``openai`` client received (with the SDK's default retries on),
by the log, and by the pool the gateway routes with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from statemachine import events as ev
from statemachine.replay import replay
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.app.conftest import add_fault
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.transcript import of
from tests.support.workers import WorkerProcess

# Both replicas fail on the poison prompt; probes (a real generation) never run again
# after the first, so nothing but the requests themselves moves the ejection counts.
SERVER_ERRORS: dict[str, dict[str, Any]] = {
    "internal_error": {"action": "reject", "status": 500, "code": "internal_error"},
    "engine_error": {"action": "engine_error"},
}
USES = 10  # each worker's fault: used once per attempt that matched it


def chat(gateway: RunningGateway, prompt: str, **options: Any) -> str:
    client = gateway.openai(**options)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True, max_tokens=6
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def fault_uses(worker: WorkerProcess) -> int:
    (fault,) = httpx.get(worker.base_url + "/admin/faults", timeout=5).json()["faults"]
    return USES - int(fault["remaining"])


@pytest.mark.parametrize("error", SERVER_ERRORS)
def test_a_request_that_fails_every_replica_with_a_server_error_is_poison(
    database_url: str, fresh_pair: list[WorkerProcess], unique_prompt: Callable[[str], str], error: str
) -> None:
    poison = unique_prompt("poison")
    for worker in fresh_pair:
        add_fault(worker, **SERVER_ERRORS[error], times=USES, match={"prompt_contains": poison})
    with running_gateway(database_url, fresh_pair, eject_after_failures=2, health_interval_s=3600) as gateway:
        for _ in range(2):  # without the verdict, two of these eject both replicas
            with pytest.raises(openai.APIStatusError) as caught:
                chat(gateway, poison, max_retries=2)  # the SDK's default: x-should-retry must stop it
            response = caught.value.response
            assert response.status_code == 502 and response.headers["x-should-retry"] == "false"
            body = caught.value.body
            assert isinstance(body, dict)
            assert (body["code"], body["retryable"], body["partial_output"]) == ("poison_request", False, False)
            events = gateway.events(response.headers["x-request-id"])
            failures = of(events, ev.UpstreamFailed)
            assert len(failures) == 2 and len({s.replica_id for s in of(events, ev.AttemptStarted)}) == 2  # type: ignore[attr-defined]
            assert all(f.upstream_status == 500 or f.upstream_code == "engine_error" for f in failures)  # type: ignore[attr-defined]
            (terminal,) = of(events, ev.RequestFailed)
            assert (terminal.code, terminal.retryable) == ("poison_request", False)  # type: ignore[attr-defined]
            assert [d.reason for d in of(events, ev.Decided)][-1] == "poison_request"  # type: ignore[attr-defined]
            assert fold(events).outcome is Outcome.FAILED and replay(events).ok
        assert [fault_uses(w) for w in fresh_pair] == [2, 2]  # one attempt each per request: no client retry
        pool = gateway.gateway.ctx.pool
        assert [r.consecutive_failures for r in pool.replicas.values()] == [0, 0]
        assert all(pool.available(r) for r in pool.replicas.values())
        assert chat(gateway, unique_prompt("healthy"))  # every replica still serves


def test_one_server_error_then_an_answer_counts_against_the_failing_replica(
    database_url: str, fresh_pair: list[WorkerProcess], unique_prompt: Callable[[str], str]
) -> None:
    prompt = unique_prompt("flaky")
    for worker in fresh_pair:
        add_fault(worker, action="engine_error", match={"prompt_contains": prompt, "attempt": 1})
    with running_gateway(database_url, fresh_pair, health_interval_s=3600) as gateway:
        stream = gateway.openai().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True, max_tokens=6
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        events = gateway.events(stream.response.headers["x-request-id"])
        failed_on, served_by = (s.replica_id for s in of(events, ev.AttemptStarted))  # type: ignore[attr-defined]
        (failure,) = of(events, ev.UpstreamFailed)
        assert failure.upstream_code == "engine_error"  # type: ignore[attr-defined]
        assert fold(events).outcome is Outcome.COMPLETED
        pool = gateway.gateway.ctx.pool
        assert (pool.replicas[failed_on].consecutive_failures, pool.replicas[served_by].consecutive_failures) == (1, 0)
