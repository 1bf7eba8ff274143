"""The chaos run's verdict (ops/chaos.py): every request a client sent, against its log.

The table it prints:

    requests      every request a client sent and got an id for
    completed     ended with [DONE]; the log says completed
    retried       needed more than one attempt (before any output)
    interrupted   ended with upstream_decode_interrupted after partial output
    other         refused or failed before output (no replica, retries spent)
    no response   the connection failed before any answer (no request id; the
                  openai client retries these); each is checked against the log below
    gateway lost  its gateway was killed under it: the log ends it gateway_lost, at
                  most two delivery batches behind what the client received, never ahead
                  (or, killed after it recorded the end it was about to send, as it says)
    violations    requests breaking a rule of statemachine.invariants, or left open (must be 0)
    events lost   a client and its log disagree: the text, the outcome, or the final error's
                  code, partial_output and delivered tokens; or output the log delivered to
                  a request no client got an answer for                    (must be 0)
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import asyncpg

from app.store.database import asyncpg_dsn
from app.store.postgres import PostgresEventStore
from app.store.queries import ended
from ops.transcript import Transcript
from statemachine import events as ev
from statemachine.invariants import violations
from statemachine.request_state import Outcome
from statemachine.state import fold


@dataclass
class Report:
    requests: int = 0
    completed: int = 0
    retried: int = 0
    interrupted: int = 0
    other: int = 0
    gateway_lost: int = 0
    no_response: int = 0
    violations: int = 0
    events_lost: int = 0
    kills: int = 0
    gateway_kills: int = 0
    problems: list[str] = field(default_factory=list)

    def table(self) -> str:
        rows = [
            ("requests", self.requests),
            ("completed", self.completed),
            ("retried", self.retried),
            ("interrupted", self.interrupted),
            ("other", self.other),
            ("gateway lost", self.gateway_lost),
            ("no response", self.no_response),
            ("violations", self.violations),
            ("events lost", self.events_lost),
            ("worker kills", self.kills),
            ("gateway kills", self.gateway_kills),
        ]
        return "\n".join(f"{name:>14} {value:>8}" for name, value in rows)


async def check(database_url: str, transcripts: list[Transcript], batch_deltas: int) -> Report:
    """Every request against its log; ``batch_deltas``: deltas per delivery batch at most."""
    report = Report()
    store = await PostgresEventStore.connect(database_url)
    try:
        if unfinished := await never_ended(database_url):
            report.problems.append(f"{len(unfinished)} request(s) never ended: {unfinished[:5]}")
            report.violations += len(unfinished)
        for transcript in transcripts:
            if not transcript.request_id:
                report.no_response += 1  # checked below, against what the log accepted
                continue
            report.requests += 1
            events = await store.read(transcript.request_id)
            if transcript.status != 200 and not events:
                report.other += 1  # refused before acceptance
                continue
            broken = violations(events)
            if broken:
                report.violations += 1
                report.problems.append(f"{transcript.request_id}: {'; '.join(broken)}")
                continue
            disagreement = _disagreement(transcript, events, batch_deltas)
            if disagreement is not None:
                report.events_lost += 1
                report.problems.append(f"{transcript.request_id}: {disagreement}")
            state = fold(events)
            report.retried += len(state.attempts) > 1
            if state.outcome is Outcome.COMPLETED:
                report.completed += 1
            elif state.error_code == "upstream_decode_interrupted":
                report.interrupted += 1
            elif state.error_code == "gateway_lost":
                report.gateway_lost += 1
            else:
                report.other += 1
        # A request the gateways accepted that no client got an answer for (its connection
        # failed first) must not have delivered anything: that output would be lost.
        seen = {transcript.request_id for transcript in transcripts}
        unseen = [rid for rid in await accepted(database_url) if rid not in seen]
        for request_id in unseen:
            if any(isinstance(e, ev.DeltasDelivered) and e.tokens for e in await store.read(request_id)):
                report.events_lost += 1
                report.problems.append(f"{request_id}: output delivered, but no client got an answer")
        if len(unseen) > report.no_response:
            report.problems.append(f"{len(unseen)} accepted requests went unanswered, {report.no_response} clients saw")
    finally:
        await store.close()
    return report


def _disagreement(transcript: Transcript, events: list[ev.Event], batch_deltas: int) -> str | None:
    """How what the client received and what its log says differ, or ``None``."""
    state = fold(events)
    deliveries = [e for e in events if isinstance(e, ev.DeltasDelivered) and e.tokens]
    logged = "".join(e.text or "" for e in deliveries)
    got = "".join(transcript.contents)
    if transcript.cut:  # the gateway died: the log may lag two batches, never lead
        behind = len(transcript.contents) - state.delivered_deltas
        # ... or it died between recording the request's end (durable, before the last
        # bytes: the completion, or a failure such as a worker that died under it) and
        # sending the finish or the final error: every delta was logged, the log ends it
        ended = state.error_code == "gateway_lost" or (state.outcome is not None and behind == 0)
        if not ended or not got.startswith(logged) or not 0 <= behind <= 2 * batch_deltas:
            return f"cut after {got!r}; the log says {logged!r} ({state.error_code}, {behind} deltas behind)"
        return None
    client_completed = transcript.done and transcript.error is None  # an error event also ends in [DONE]
    if got != logged or client_completed != (state.outcome is Outcome.COMPLETED):
        return f"the client got {got!r} (completed: {client_completed}), the log says {logged!r} ({state.outcome})"
    error = transcript.error
    if error is not None and (
        error.get("code") != state.error_code
        or error.get("partial_output") is not state.first_delta_sent
        or error.get("delivered_output_tokens") != state.delivered_output_tokens
    ):
        return f"the client was told {error}, the log says {state.error_code} after {state.delivered_output_tokens}"
    return None


# The verdict reads the log, never a read model that may trail it (docs/read-models.md):
# a request is accepted by its first event, ended by its terminal one.
_ACCEPTED = "SELECT request_id FROM request_events WHERE version = 1 ORDER BY request_id"
_NEVER_ENDED = f"""
SELECT accepted.request_id FROM request_events accepted
 WHERE accepted.version = 1 AND NOT {ended("accepted")}
 ORDER BY accepted.request_id
"""


async def accepted(database_url: str) -> list[str]:
    return await _request_ids(database_url, _ACCEPTED)


async def never_ended(database_url: str) -> list[str]:
    return await _request_ids(database_url, _NEVER_ENDED)


async def _request_ids(database_url: str, query: str) -> list[str]:
    connection = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        return [row["request_id"] for row in await connection.fetch(query)]
    finally:
        await connection.close()


async def until_all_ended(database_url: str, timeout_s: float) -> None:
    """Wait until no request is open: the sweeps of killed gateways are done."""
    connection = await asyncpg.connect(asyncpg_dsn(database_url))  # one, for every look
    try:
        deadline = time.monotonic() + timeout_s
        while await connection.fetch(_NEVER_ENDED) and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
    finally:
        await connection.close()
