"""``ops/bench/studies/windowed_projection.py`` appends the same batches every way, and a projector
that trails the log by a window writes the same read models, row for row, as the append's
own projection, updating a request's row once a window instead of once a batch."""

from __future__ import annotations

import pytest

from ops.bench.studies.windowed_projection import GROUPS, batches, measure, report, requests_rows


def test_the_batches_hold_every_moment_of_a_request_in_order() -> None:
    made = batches(requests_rows(12), streams=6, every=3)
    rows = [row for batch in made for row in batch]
    assert len(rows) == 12 * sum(GROUPS)
    for request_id in {row.request_id for row in rows}:  # each request's rows in version order
        versions = [row.version for row in rows if row.request_id == request_id]
        assert versions == list(range(1, sum(GROUPS) + 1))
    assert max(len({row.request_id for row in batch}) for batch in made) <= 6  # in flight at once


async def test_a_trailing_projector_writes_the_same_read_models_in_fewer_updates(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    requests = 24
    ways = await measure(database_url, requests, streams=8, every=2, windows=[1, 6])  # equal read models, or raises
    append, window_1, window_6 = ways
    assert append.appends > 0 and append.projector == 0
    assert all(way.appends > 0 and way.projector > 0 for way in (window_1, window_6))
    # a row inserted, then updated once each of a request's 9 transactions; once a window
    assert append.updates["requests"] == window_1.updates["requests"] == requests * (1 + len(GROUPS))
    assert window_6.updates["requests"] < append.updates["requests"]
    assert append.updates["request_attempts"] == window_6.updates["request_attempts"] == requests * 3
    report(ways, requests)
    printed = capsys.readouterr().out
    assert "in the append" in printed and "trailing, window 6" in printed
