"""A fallback model's attempts stay on the revision its first attempt was placed at
(docs/design.md §16), as the request's own model's stay on ``RequestAccepted``'s: a
configuration that switches the fallback's revision meanwhile moves none of its retries
onto other weights. Real parts: a gateway on PostgreSQL, sim worker processes, the admin
API, a reload of the configuration as ``SIGHUP`` applies it."""

from __future__ import annotations

import dataclasses
import threading
from contextlib import ExitStack

import httpx

from statemachine import events as ev
from tests.app.conftest import add_fault
from tests.app.driver.test_fleet_changes import AUTH, TOKEN, wait_for
from tests.support.gateway import MODEL, running_gateway
from tests.support.workers import WorkerProcess, running_worker

FALLBACK = "sim-fallback"
ARGS = ["--sim-decode-ms-per-token", "20", "--heartbeat-ms", "100", "--max-model-len", "512"]


def test_a_fallback_s_retry_stays_on_the_revision_its_first_attempt_was_placed_at(database_url: str) -> None:
    routing = {"strategy": "least_outstanding", "models": {MODEL: {"fallbacks": [FALLBACK]}}}
    with ExitStack() as stack:
        gateway = stack.enter_context(
            running_gateway(database_url, [], admin_token=TOKEN, models={MODEL: "A", FALLBACK: "A"}, routing=routing)
        )
        own = stack.enter_context(running_worker(faults=True, args=[*ARGS, "--model", f"{MODEL}=A"]))
        workers: dict[str, WorkerProcess] = {
            name: stack.enter_context(running_worker(faults=True, args=[*ARGS, "--model", f"{FALLBACK}={name[0]}"]))
            for name in ("A1", "A2", "B1")
        }
        for name, worker, model in [("own", own, f"{MODEL}=A")] + [
            (name, worker, f"{FALLBACK}={name[0]}") for name, worker in workers.items()
        ]:
            body = {"id": name, "url": worker.base_url, "kind": "worker", "models": [model]}
            assert httpx.post(f"{gateway.url}/admin/replicas", json=body, headers=AUTH).status_code == 201
        wait_for(lambda: len(gateway.gateway.ctx.pool.replicas) == 4)
        # the request's own model refuses it: it falls back, and its first fallback attempt
        # is held in prefill on whichever A replica it was placed
        add_fault(own, action="reject", status=503, match={"prompt_contains": "pin me"}, times=None)
        for name in ("A1", "A2"):
            add_fault(workers[name], action="hold", at_token=0, match={"prompt_contains": "pin me"}, times=1)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "pin me"}], "max_tokens": 4}
        answer: dict[str, httpx.Response] = {}
        asking = threading.Thread(
            target=lambda: answer.setdefault(
                "r", httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=60)
            )
        )
        asking.start()
        pool = gateway.gateway.ctx.pool
        wait_for(lambda: any(pool.replicas[n].outstanding == 1 for n in ("A1", "A2")), 20.0)
        first = next(n for n in ("A1", "A2") if pool.replicas[n].outstanding == 1)
        other = "A2" if first == "A1" else "A1"
        httpx.delete(f"{workers[other].base_url}/admin/faults", timeout=5)  # the retry there runs
        # the fallback's revision switched to B (a reload), then its first attempt's replica dies
        switched = dataclasses.replace(gateway.config, models={MODEL: "A", FALLBACK: "B"})
        gateway.loop.call_soon_threadsafe(gateway.gateway.reload, switched)
        wait_for(lambda: gateway.gateway.ctx.config.model_revision(FALLBACK) == "B")
        workers[first].kill()
        asking.join(60)
        response = answer["r"]
        assert response.status_code == 200, response.text
        events = gateway.events(response.headers["x-request-id"])
    started = [e for e in events if isinstance(e, ev.AttemptStarted)]
    on_fallback = [e for e in started if e.model == FALLBACK]
    assert [e.replica_id for e in on_fallback] == [first, other]  # never B1, though B is configured now
    assert [e.model_revision for e in on_fallback] == ["A", "A"]  # pinned, in the log
    assert all(e.model is None and e.model_revision is None for e in started if e not in on_fallback)
