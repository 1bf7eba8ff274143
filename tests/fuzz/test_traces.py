"""The trace family: ``phasegate trace import`` of a recorded trace with one of its strings
(the request id, the tenant, the model, a replica id, the delivered text) replaced by
generated text, the kinds that broke the import before among it (NUL, lone surrogates,
high and low). Each case either imports the whole trace (exit 0) or refuses it naming
the line (exit 2), never a traceback, and a refused trace leaves the log as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
from pathlib import Path

import asyncpg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.cli import main
from app.store.database import asyncpg_dsn
from tests.fuzz import strategies as s
from tests.fuzz.conftest import Tally, fuzz_settings

TRACE = Path(__file__).resolve().parents[1] / "traces" / "clean_completion.jsonl"
# the trace's own strings, each as it stands in the file (a JSON string with its quotes)
FIELDS = {
    "request id": '"req_clean"',
    "tenant": '"default"',
    "model": '"tiny"',
    "replica id": '"w1"',
    "delivered text": '"Hi Hi Hi "',
}


def test_trace_import(package_database_url: str, tally: Tally, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", package_database_url)
    original = TRACE.read_text()
    assert all(quoted in original for quoted in FIELDS.values())
    events = len(original.splitlines()) - 1  # the header is not an event
    numbers = itertools.count()

    @fuzz_settings()
    @given(field=st.sampled_from(sorted(FIELDS)), text=s.TEXT)
    def property_(field: str, text: str) -> None:
        if field == "request id":  # unique, so that a trace is never refused only as a duplicate
            text = f"{text}{next(numbers)}"
        trace = tmp_path / "trace.jsonl"
        trace.write_text(original.replace(FIELDS[field], json.dumps(text)))  # escaped: "\ud800" stays six characters
        before = count_events(package_database_url)
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            status = main(["trace", "import", str(trace)])
        tally.record(f"trace.import.{field.replace(' ', '_')}", status)
        assert status in (0, 2), (field, text, status, err.getvalue())
        after = count_events(package_database_url)
        if status == 2:
            assert f"{trace}: line " in err.getvalue() or "nothing was imported" in err.getvalue(), err.getvalue()
            assert after == before, "a refused trace changed the log"
        else:
            assert after == before + events

    property_()


def count_events(url: str) -> int:
    async def count() -> int:
        connection = await asyncpg.connect(asyncpg_dsn(url))
        try:
            return int(await connection.fetchval("SELECT count(*) FROM request_events"))
        finally:
            await connection.close()

    return asyncio.run(count())
