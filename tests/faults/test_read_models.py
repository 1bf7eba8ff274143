"""The read models against the fold, on a log a real gateway wrote while replicas died.

The ``database_url`` fixture of tests/faults/conftest.py runs ``fold_disagreements``
after every fault test; this test shows that the check speaks on such a log: it finds
nothing on what the gateway wrote, and names the one field of one request that SQL
then changed behind the log's back.
"""

from __future__ import annotations

import uuid

import httpx

from statemachine.request_state import Outcome
from tests.support.audit import execute_sql, fold_disagreements_in, read_model_row
from tests.support.gateway import MODEL, running_gateway
from tests.support.transcript import check_request, stream_chat
from tests.support.workers import running_worker

SIM_ARGS = ["--model", MODEL, "--sim-decode-ms-per-token", "3", "--heartbeat-ms", "100"]


def test_the_audit_finds_nothing_on_a_real_log_and_names_a_tampered_read_model_field(database_url: str) -> None:
    retried, interrupted = f"retried {uuid.uuid4().hex[:8]}", f"interrupted {uuid.uuid4().hex[:8]}"
    with (
        running_worker(faults=True, args=SIM_ARGS) as first,
        running_worker(faults=True, args=SIM_ARGS) as second,
    ):
        for worker in (first, second):  # attempt 1 of one is refused, attempt 1 of the other dies mid-answer
            faults = [
                {"action": "reject", "status": 503, "times": None, "match": {"prompt_contains": retried, "attempt": 1}},
                {"action": "die", "point": "after_frame", "at_token": 2, "match": {"prompt_contains": interrupted}},
            ]
            httpx.post(worker.base_url + "/admin/faults", json={"faults": faults}).raise_for_status()
        with running_gateway(database_url, [first, second]) as gateway:
            body = {"model": MODEL, "max_tokens": 8, "seed": 1}
            answers = [
                stream_chat(gateway.url, {**body, "messages": [{"role": "user", "content": prompt}]})
                for prompt in (retried, interrupted)
            ]
            states = [check_request(gateway.events(t.request_id), t) for t in answers]
    assert [s.outcome for s in states] == [Outcome.COMPLETED, Outcome.FAILED]
    assert [len(s.attempts) for s in states] == [2, 1]
    ids = [t.request_id for t in answers]
    assert fold_disagreements_in(database_url, ids) == []
    cut = ids[1]
    delivered = read_model_row(database_url, cut)["delivered_output_tokens"]
    assert delivered == states[1].delivered_output_tokens == 3
    statement = "UPDATE requests SET delivered_output_tokens = :value WHERE request_id = :request_id"
    assert execute_sql(database_url, statement, value=delivered + 1, request_id=cut) == 1
    found = fold_disagreements_in(database_url, ids)
    assert [(d.request_id, d.field, d.folded, d.projected) for d in found] == [
        (cut, "delivered_output_tokens", delivered, delivered + 1)
    ]
    execute_sql(database_url, statement, value=delivered, request_id=cut)  # as it was, for the fixture's audit
