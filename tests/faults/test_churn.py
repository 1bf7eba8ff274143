"""The churn soak, two minutes of it (``SECONDS``): mixed traffic through two gateway instances on one
PostgreSQL while workers join, leave, are cordoned, uncordoned and SIGKILLed, a DNS name's
records change and the configuration is reloaded, one gateway is restarted and PostgreSQL is
restarted (docs/design.md §16). The full run is
``python ops/churn.py --seconds 1800`` (docs/operations.md).

The verdict judges every request by what its client received against its log; the checks
are then shown to fail on answers doctored from real ones, checked against the same logs:
a check that cannot fail proves nothing.
"""

from __future__ import annotations

import asyncio
import copy
import os
from typing import Any

import pytest

from ops.churn import BATCH_DELTAS, run_churn
from ops.churn_check import CHECKS, Verdict, check
from ops.churn_sources import dnsmasq_binary
from ops.churn_traffic import KINDS, Record

# Two minutes in every run; PHASEGATE_CHURN=1 asks for ten, PHASEGATE_CHURN_SECONDS for
# any length (the full run is ops/churn.py's, docs/operations.md)
pytestmark = pytest.mark.slow
SECONDS = float(os.environ.get("PHASEGATE_CHURN_SECONDS") or (600.0 if os.environ.get("PHASEGATE_CHURN") else 120.0))

FLEET_CHANGES = ("join", "leave", "drain", "cordon", "uncordon", "kill", "gateway restart", "postgres restart")
SOURCE_CHANGES = ("dns add", "dns remove", "reload add", "reload remove")  # with dnsmasq (.ci/dnsmasq)


def doctored(records: list[Record]) -> dict[str, list[Record]]:
    """For each check, every answer as received but one or two, altered the way it must catch."""
    streamed = [r for r in records if r.kind == "chat_stream" and r.transcript.done and len(r.transcript.contents) >= 2]
    resumed = next(r for r in records if r.resumed and r.transcript.done and len(r.transcript.contents) >= 3)
    polled = next(r for r in records if r.kind == "responses_bg" and r.whole and r.whole["status"] == "completed")
    originals = [streamed[0], streamed[1], resumed, polled]
    spliced, short, replayed, pending = altered = [copy.deepcopy(r) for r in originals]
    spliced.transcript.contents[1] = "another attempt's words"
    del short.transcript.contents[-1], short.transcript.event_ids[-1], short.transcript.kinds[-1]
    replayed.transcript.event_ids.insert(2, replayed.transcript.event_ids[1])  # a delta sent twice
    replayed.transcript.contents.insert(2, replayed.transcript.contents[1])
    replayed.transcript.kinds.insert(2, replayed.transcript.kinds[1])
    assert pending.whole is not None
    pending.whole["status"] = "in_progress"

    def swapped(*which: int) -> list[Record]:
        by_id = {id(originals[n]): altered[n] for n in which}
        return [by_id.get(id(r), r) for r in records]

    return {"differs": swapped(0, 1), "spliced/dup": swapped(2), "never ended": swapped(3)}


def test_two_minutes_of_churn_leave_every_client_agreeing_with_its_log() -> None:
    caught: dict[str, Verdict] = {}

    def recheck(database_url: str, records: list[Record]) -> None:
        for name, altered in doctored(records).items():
            caught[name] = Verdict()
            asyncio.run(check(database_url, altered, BATCH_DELTAS, caught[name]))

    verdict = run_churn(seconds=SECONDS, clients_count=12, churn_every_s=2.0, decode_ms=10.0, seed=3, after=recheck)
    print(verdict.table())
    print("\n".join(verdict.problems))
    failing = {name: verdict.failed[name] for name in CHECKS if verdict.failed[name]}
    assert verdict.passed, (failing, verdict.problems[:10])
    # the run did what it says: every kind of request, every kind of fleet change
    by_kind: dict[str, Any] = {kind: 0 for kind in KINDS}
    for (kind, outcome), count in verdict.outcomes.items():
        by_kind[kind] += count if outcome in ("completed", "retried+ok") else 0
    assert all(count >= 10 for count in by_kind.values()), by_kind
    assert all(verdict.fleet[change] >= 1 for change in FLEET_CHANGES), verdict.fleet
    if dnsmasq_binary() is not None:  # the declared sources changed too, each change's propagation timed
        assert all(verdict.fleet[change] >= 1 for change in SOURCE_CHANGES), verdict.fleet
        assert {line.split()[0] for line in verdict.propagation} == {"dns", "reload"}, verdict.propagation
    assert verdict.fleet["join"] + verdict.fleet["kill"] + verdict.fleet["leave"] >= 10, verdict.fleet
    # RSS read through the run: the gateway never restarted has all four quarters
    assert any(all(quarters) for quarters in verdict.rss.values()), verdict.rss
    # and each check fails on the answers doctored for it, and only on those
    expected = {"differs": 2, "spliced/dup": 1, "never ended": 1}
    for name, altered in caught.items():
        want = {check: expected[name] if check == name else 0 for check in CHECKS[:3]}
        assert {check: altered.failed[check] for check in CHECKS[:3]} == want, (name, altered.problems)
