"""The churn soak's verdict (ops/churn.py): every request a client sent, against its log,
and each gateway's memory over the run.

Per request, judging only by what the client received and the request's log:

    spliced/dup   a streamed answer whose SSE ids skip or repeat (a resume that replayed or
                  lost a delta, or two attempts' output joined), or whose log breaks a rule of
                  statemachine.invariants (output from a second attempt after the first delta)
    never ended   the log holds no terminal event for it (every accepted request, whoever sent
                  it), or the client never saw an end: a stream with neither [DONE] nor a final
                  error nor a cut connection, a background response still not ended when polled
    differs       what the client received is not what its log says was delivered: the text
                  (tool-call deltas apart), the outcome, the final error's code and tokens; a cut
                  stream may be ahead of its log by two delivery batches at most, never behind;
                  output the log delivered to a request no client got an answer for
    rss growth    a gateway's resident memory, median of the last quarter of the run over the
                  median of the first, above 1.10, for each gateway that ran the whole run (the
                  restarted one's new process starts cold mid-run: shown, not judged), in a run
                  of ten minutes or more: a shorter run's first quarter is its warm-up (pools,
                  caches and the allocator's arenas filling), so its quarters are shown, not judged
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

from app.api.resume.log import deltas_of
from app.store.postgres import PostgresEventStore
from ops.chaos_check import accepted, never_ended
from ops.churn_traffic import Record
from statemachine import events as ev
from statemachine.deltas import TOOL_CALLS
from statemachine.invariants import violations
from statemachine.request_state import Outcome
from statemachine.state import fold

RSS_GROWTH_LIMIT = 1.10
RSS_JUDGED_FROM_S = 600.0  # a two-minute run's gateway grew 11.6 % filling up, then held
CHECKS = ("spliced/dup", "never ended", "differs", "rss growth")


@dataclass
class Sample:
    gateway: int
    incarnation: int
    at: float  # seconds into the run
    rss_kib: int


@dataclass
class Verdict:
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)  # (kind, outcome)
    fleet: Counter[str] = field(default_factory=Counter)  # fleet changes by kind
    failed: Counter[str] = field(default_factory=Counter)  # check -> requests (or gateways) failing it
    rss: dict[str, list[int | None]] = field(default_factory=dict)  # gateway incarnation -> per quarter
    problems: list[str] = field(default_factory=list)
    propagation: list[str] = field(default_factory=list)  # declared sources' changes, timed (ops/churn_sources.py)

    @property
    def passed(self) -> bool:
        return not any(self.failed[check] for check in CHECKS)

    def fail(self, check: str, problem: str) -> None:
        self.failed[check] += 1
        self.problems.append(f"{check}: {problem}")

    def table(self) -> str:
        kinds = sorted({kind for kind, _ in self.outcomes})
        names = sorted({outcome for _, outcome in self.outcomes})
        lines = [f"{'requests':<28}" + "".join(f"{k:>13}" for k in [*kinds, "all"])]
        for name in names:
            counts = [self.outcomes[k, name] for k in kinds]
            lines.append(f"{name:<28}" + "".join(f"{c:>13}" for c in [*counts, sum(counts)]))
        totals = [sum(self.outcomes[k, n] for n in names) for k in kinds]
        lines.append(f"{'all':<28}" + "".join(f"{c:>13}" for c in [*totals, sum(totals)]))
        lines.append("")
        lines.append("fleet changes  " + "  ".join(f"{k} {v}" for k, v in sorted(self.fleet.items())))
        lines.append("")
        if self.propagation:
            lines += ["propagation (change -> listed serving, or no longer)", *self.propagation, ""]
        for check in CHECKS:
            lines.append(f"{check:<14} {self.failed[check]:>6}  {'FAIL' if self.failed[check] else 'ok'}")
        lines.append("")
        lines.append(f"{'rss MiB':<14}" + "".join(f"{'Q' + str(q):>9}" for q in range(1, 5)) + "   growth")
        for name, quarters in self.rss.items():
            cells = "".join(f"{q / 1024:>9.1f}" if q else f"{'-':>9}" for q in quarters)
            first, last = quarters[0], quarters[-1]
            growth = f"{(last / first - 1) * 100:+7.1f} %" if first and last else "      -"
            lines.append(f"{name:<14}{cells}  {growth}")
        return "\n".join(lines)


def logged_text(events: list[ev.Event]) -> str:
    """The text the log says was delivered (a tool-call delta's JSON is not text)."""
    return "".join(
        delta.text
        for e in events
        if isinstance(e, ev.DeltasDelivered)
        for delta in deltas_of(e)
        if delta.key != TOOL_CALLS
    )


def answer_text(events: list[ev.Event]) -> str:
    """The final attempt's text as a whole answer reads it from the log: its deltas,
    delivered or produced while no client was attached (docs/design.md §12)."""
    state = fold(events)
    final = state.current_attempt.attempt if state.current_attempt is not None else 0
    answer = {
        delta.index: delta.text
        for e in events
        if isinstance(e, ev.DeltasDelivered | ev.DeltasProduced) and e.attempt == final
        for delta in deltas_of(e)
        if delta.key != TOOL_CALLS
    }
    return "".join(answer[index] for index in sorted(answer))


def logged_tool_calls(events: list[ev.Event]) -> bool:
    return any(delta.key == TOOL_CALLS for e in events if isinstance(e, ev.DeltasDelivered) for delta in deltas_of(e))


async def check(database_url: str, records: list[Record], batch_deltas: int, verdict: Verdict) -> None:
    """Every record against its request's log, into ``verdict``."""
    store = await PostgresEventStore.connect(database_url)
    try:
        for request_id in await never_ended(database_url):
            verdict.fail("never ended", f"{request_id}: no terminal event in its log")
        no_response = 0
        for record in records:
            transcript = record.transcript
            if not transcript.request_id:
                no_response += 1  # checked below, against what the log accepted
                verdict.outcomes[record.kind, "no response"] += 1
                continue
            events = await store.read(transcript.request_id)
            if not events:
                verdict.outcomes[record.kind, f"refused {transcript.status}"] += 1
                continue
            broken = violations(events)
            if broken:
                verdict.fail("spliced/dup", f"{transcript.request_id}: {'; '.join(broken)}")
            state = fold(events)
            verdict.outcomes[record.kind, _outcome(state.outcome, state.error_code, len(state.attempts))] += 1
            _judge(record, events, batch_deltas, verdict)
        seen = {record.transcript.request_id for record in records}
        unseen = [rid for rid in await accepted(database_url) if rid not in seen]
        for request_id in unseen:
            if any(isinstance(e, ev.DeltasDelivered) and e.tokens for e in await store.read(request_id)):
                verdict.fail("differs", f"{request_id}: output delivered, but no client got an answer")
        if len(unseen) > no_response:
            verdict.problems.append(f"note: {len(unseen)} accepted requests went unanswered, {no_response} seen")
    finally:
        await store.close()


def _outcome(outcome: Outcome | None, error_code: str | None, attempts: int) -> str:
    if outcome is Outcome.COMPLETED:
        return "retried+ok" if attempts > 1 else "completed"
    return error_code or (outcome.value if outcome is not None else "open")


def _judge(record: Record, events: list[ev.Event], batch_deltas: int, verdict: Verdict) -> None:
    transcript, state = record.transcript, fold(events)
    rid = f"{transcript.request_id} ({record.kind})"
    completed = state.outcome is Outcome.COMPLETED
    # a resumed stream: what was delivered before the client left, then the rest from the log,
    # produced while no client was attached included (docs/design.md §12)
    logged = answer_text(events) if record.resumed else logged_text(events)
    if record.kind in ("chat_whole", "responses_bg"):
        whole = record.whole
        if whole is None:  # refused, or the connection failed after the gateway accepted it
            code = (transcript.error or {}).get("code")
            if transcript.status >= 400 and state.outcome is not None and code != state.error_code:
                verdict.fail("differs", f"{rid}: the client was told {code}, the log says {state.error_code}")
            return
        text = answer_text(events)
        if whole["status"] not in ("completed", "failed", "cancelled", "incomplete"):
            notes = f" ({len(record.notes)} polls refused: {record.notes[-2:]})" if record.notes else ""
            verdict.fail("never ended", f"{rid}: still {whole['status']} when the client stopped polling{notes}")
        elif (whole["status"] in ("completed", "incomplete") and not whole.get("error")) != completed:
            verdict.fail("differs", f"{rid}: the client got {whole['status']}, the log says {state.outcome}")
        elif whole["text"] != text:
            verdict.fail("differs", f"{rid}: the client got {whole['status']} {whole['text']!r}, the log {text!r}")
        return
    if transcript.status != 200:
        if transcript.error and transcript.error.get("code") != state.error_code and state.outcome is not None:
            verdict.fail("differs", f"{rid}: refused {transcript.error.get('code')}, the log says {state.error_code}")
        return
    if transcript.event_ids != list(range(len(transcript.event_ids))):
        verdict.fail("spliced/dup", f"{rid}: SSE ids {transcript.event_ids}")
        return
    got = transcript.text
    if record.gave_up:
        verdict.fail("never ended", f"{rid}: no gateway resumed it to its end")
        return
    if transcript.cut and not record.resumed:  # its gateway died: the log may trail by two delivery batches, never lead
        behind = len(transcript.contents) - state.delivered_deltas
        ended = state.error_code == "gateway_lost" or (state.outcome is not None and behind == 0)
        if not ended or not got.startswith(logged) or not 0 <= behind <= 2 * batch_deltas:
            verdict.fail("differs", f"{rid}: cut after {got!r}; the log {logged!r} ({state.error_code}, {behind})")
        return
    if not transcript.done and transcript.error is None:
        verdict.fail("never ended", f"{rid}: the stream stopped with neither [DONE] nor an error")
        return
    client_completed = transcript.done and transcript.error is None
    if got != logged or client_completed != completed:
        verdict.fail("differs", f"{rid}: the client got {got!r} ({client_completed}), the log {logged!r}")
    elif completed and bool(transcript.tool_calls) != logged_tool_calls(events):
        verdict.fail("differs", f"{rid}: tool calls: the client got {transcript.tool_calls}, the log disagrees")
    elif transcript.error is not None and (
        transcript.error.get("code") != state.error_code
        or transcript.error.get("delivered_output_tokens") != _failed_after(events)
    ):
        verdict.fail(
            "differs", f"{rid}: told {transcript.error}, the log {state.error_code} after {_failed_after(events)}"
        )


def _failed_after(events: list[ev.Event]) -> int | None:
    """The tokens its ``RequestFailed`` says were delivered: what its error tells every
    reader. A read after the end (a resume that read the output produced meanwhile) counts
    toward the fold's delivered tokens (docs/design.md §15), not toward the error's."""
    failed = next((e for e in events if isinstance(e, ev.RequestFailed)), None)
    return failed.delivered_output_tokens if failed is not None else None


def judge_rss(samples: list[Sample], seconds: float, verdict: Verdict) -> None:
    """Median RSS per quarter of the run, per gateway incarnation; growth judged for the
    gateways that ran the whole run (a restarted one starts cold mid-run: shown, not judged)."""
    for gateway, incarnation in sorted({(s.gateway, s.incarnation) for s in samples}):
        mine = [s for s in samples if (s.gateway, s.incarnation) == (gateway, incarnation)]
        quarters: list[int | None] = []
        for q in range(4):
            inside = [s.rss_kib for s in mine if q * seconds / 4 <= s.at < (q + 1) * seconds / 4]
            quarters.append(int(statistics.median(inside)) if inside else None)
        name = f"gateway {gateway}" + (f" #{incarnation + 1}" if incarnation else "")
        verdict.rss[name] = quarters
        first, last = quarters[0], quarters[-1]
        if incarnation == 0 and first and last and last > first * RSS_GROWTH_LIMIT:
            growth = f"{name}: {first} KiB in the first quarter, {last} KiB in the last"
            if seconds >= RSS_JUDGED_FROM_S:
                verdict.fail("rss growth", growth)
            else:
                verdict.problems.append(f"note: {growth} (a {seconds:.0f} s run: its warm-up, not judged)")
