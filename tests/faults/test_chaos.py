"""The chaos run, reduced: workers killed and restarted under concurrent streams.

The full run is ``python ops/chaos.py`` (500 streams, 60 s); this one keeps CI short
but still kills workers mid-stream several times, and must end with no violation
and no lost event.
"""

from __future__ import annotations

from ops.chaos import run_chaos


def test_a_reduced_chaos_run_keeps_every_invariant(database_url: str) -> None:
    report = run_chaos(database_url, streams=20, seconds=10.0, workers=3, kill_every_s=2.0, decode_ms=10.0, seed=3)
    print(report.table())
    assert report.problems == [] and report.violations == 0 and report.events_lost == 0
    assert report.kills >= 2 and report.requests >= 50
    assert report.retried + report.interrupted >= 1, "the kills hit no request: the run proved nothing"
    assert report.completed + report.interrupted + report.gateway_lost + report.other == report.requests


def test_a_chaos_run_over_gateways_that_die_keeps_every_client_and_its_log_agreeing(database_url: str) -> None:
    report = run_chaos(
        database_url,
        streams=24,
        seconds=12.0,
        workers=2,
        kill_every_s=4.0,
        decode_ms=15.0,
        seed=5,
        gateways=3,
        kill_gateway_every_s=3.0,
    )
    print(report.table())
    assert report.problems == [] and report.violations == 0 and report.events_lost == 0
    assert report.gateway_kills >= 2 and report.requests >= 50
    assert report.gateway_lost >= 1, "the gateway kills hit no stream: the run proved nothing"
    assert report.completed + report.interrupted + report.gateway_lost + report.other == report.requests
