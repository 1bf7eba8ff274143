"""A background response whose input's write meets PostgreSQL away (docs/design.md §15):
the input is written once the log takes writes again, before the response completes,
so that a poll reads the response, never "deleted"; and where it is never written, the
response ends failed as the log lost it, and a poll says so.

PostgreSQL refuses the inputs' inserts with SQLSTATE 57P03 (``cannot_connect_now``, a
server starting or stopping) from a trigger, as a restart refuses them, while the log's
own appends go on: the moment the churn soak met (ops/churn.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import asyncpg
import openai
import pytest

from app.store.database import asyncpg_dsn
from statemachine import events as ev
from tests.app.api.test_responses import request_id_of
from tests.support.gateway import MODEL, running_gateway
from tests.support.transcript import of
from tests.support.workers import WorkerProcess

REFUSE = """
CREATE OR REPLACE FUNCTION refuse_inputs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'the database system is shutting down' USING ERRCODE = '57P03';
END $$;
CREATE TRIGGER refuse_inputs BEFORE INSERT ON request_inputs FOR EACH ROW EXECUTE FUNCTION refuse_inputs();
"""
ALLOW = "DROP TRIGGER IF EXISTS refuse_inputs ON request_inputs"


def _sql(database_url: str, statement: str) -> None:
    async def run() -> None:
        connection = await asyncpg.connect(asyncpg_dsn(database_url))
        try:
            await connection.execute(statement)
        finally:
            await connection.close()

    asyncio.run(run())


@pytest.fixture
def inputs_refused(database_url: str) -> Iterator[Callable[[], None]]:
    """Inputs refused from now on; the fixture's value lets them in again."""
    _sql(database_url, REFUSE)
    try:
        yield lambda: _sql(database_url, ALLOW)
    finally:
        _sql(database_url, ALLOW)


def test_a_background_response_whose_input_met_an_outage_is_read_back_whole(
    database_url: str,
    sim_pair: list[WorkerProcess],
    inputs_refused: Callable[[], None],
    unique_prompt: Callable[[str], str],
) -> None:
    prompt = unique_prompt("input through an outage")
    with running_gateway(database_url, sim_pair) as gateway:
        client = gateway.openai()
        queued = client.responses.create(model=MODEL, input=prompt, max_output_tokens=8, background=True)
        request_id = request_id_of(queued)
        # its generation ends long before this; its completion waits for its input
        allowed = threading.Timer(1.5, inputs_refused)
        allowed.start()
        try:
            deadline = time.monotonic() + 30
            read = client.responses.retrieve(queued.id)
            while read.status in ("queued", "in_progress"):
                assert time.monotonic() < deadline, read.status
                time.sleep(0.1)
                read = client.responses.retrieve(queued.id)
        finally:
            allowed.join()
        assert read.status == "incomplete" and read.output_text  # its max_output_tokens reached
        items = client.responses.input_items.list(queued.id)
        assert [i.content[0].text for i in items.data] == [prompt]  # type: ignore[union-attr]
        events = gateway.events(request_id)
    completed = of(events, ev.RequestCompleted)
    assert len(completed) == 1 and not of(events, ev.RequestFailed)


def test_a_background_response_whose_input_is_never_written_ends_failed_and_is_read_so(
    database_url: str,
    sim_pair: list[WorkerProcess],
    inputs_refused: Callable[[], None],
    unique_prompt: Callable[[str], str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("app.driver.driver.STORE_OUTAGE_GRACE_S", 1.0)  # the input's retries give up sooner
    prompt = unique_prompt("input never written")
    with running_gateway(database_url, sim_pair) as gateway:
        client = gateway.openai()
        queued = client.responses.create(model=MODEL, input=prompt, max_output_tokens=8, background=True)
        request_id = request_id_of(queued)
        gateway.wait_logged(request_id, lambda events: of(events, ev.RequestFailed), timeout=60)
        read = client.responses.retrieve(queued.id)  # still refused: the log has no input for it
        assert read.status == "failed" and read.error is not None
        assert read.error.code == "event_log_unavailable"
        with pytest.raises(openai.BadRequestError) as refused:  # nothing to list, and it says why
            client.responses.input_items.list(queued.id)
        assert refused.value.code == "response_content_unavailable"
        events = gateway.events(request_id)
    assert not of(events, ev.RequestCompleted)
    failed = of(events, ev.RequestFailed)
    assert len(failed) == 1 and failed[0].code == "event_log_unavailable"  # type: ignore[attr-defined]
