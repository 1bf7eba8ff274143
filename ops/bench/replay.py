"""Offline replay throughput: events per second from a trace file to a verdict, on one core.

    python ops/bench/replay.py                      # 2,000 requests, best of 5 rounds
    python ops/bench/replay.py --requests 500 --rounds 3 --profile

A night's worth of requests is generated the way the gateway logs them (every
decision recorded from ``decide()``, so the trace replays without divergence): most
complete with a 256-token answer delivered in batches of 16 tokens, some are retried
before the first delta, fenced then retried, or interrupted in decode. They are
written as one JSONL trace, then each round times, in this process:

- parse:   the file's lines to events (``statemachine.trace.parse_trace``);
- replay:  every request folded and every decision recomputed and compared
  (``statemachine.replay.replay``), the events already parsed;
- offline: both, as ``phasegate replay trace.jsonl`` does (less printing the report).

The target is 100,000 events/s replayed offline. ``--profile`` prints where the time
of one offline round goes.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from statemachine import events as ev  # noqa: E402
from statemachine.actions import FailRequest  # noqa: E402
from statemachine.events import Event, FailureKind, ReleaseReason  # noqa: E402
from statemachine.policy import decide, decided_fields  # noqa: E402
from statemachine.policy_config import PolicyConfig  # noqa: E402
from statemachine.replay import replay  # noqa: E402
from statemachine.request_state import RequestState  # noqa: E402
from statemachine.state import advance  # noqa: E402
from statemachine.trace import dump_trace, parse_trace  # noqa: E402

TARGET = 100_000
T0 = datetime(2026, 11, 30, tzinfo=UTC)


class Request:
    """One request's log, built event by event and folded as it goes (so it is legal)."""

    def __init__(self, request_id: str, at: datetime) -> None:
        self.request_id = request_id
        self.clock = at
        self.events: list[Event] = []
        self.state = RequestState(request_id=request_id)
        self.add(
            ev.RequestAccepted,
            model="llama",
            model_revision="r1",
            tenant="acme",
            endpoint="chat.completions",
            stream=True,
            params_digest="sha256:00",
            prompt_tokens=180,
            n=1,
            guided=False,
            tools=False,
            idempotency_key=None,
            max_attempts=2,
            seed=None,
            gateway="gw-1",
        )
        self.decide()

    def add(self, cls: type[Event], **fields: Any) -> None:
        self.clock += timedelta(milliseconds=3)
        self.state, event = advance(self.state, cls, self.clock, **fields)
        self.events.append(event)

    def decide(self) -> list[Any]:
        actions = decide(self.state, PolicyConfig())
        for action in actions:
            self.state, decided = advance(self.state, ev.Decided, self.clock, **decided_fields(action))
            self.events.append(decided)
        return actions

    def scope(self) -> dict[str, int]:
        current = self.state.current_attempt
        assert current is not None
        return {"attempt": current.attempt, "lease_epoch": current.lease_epoch}

    def start(self, replica: str) -> None:
        number = len(self.state.attempts) + 1
        self.add(ev.AttemptStarted, attempt=number, lease_epoch=number, replica_id=replica, lease_expires_at=self.clock)

    def answer(self, batches: int) -> None:
        self.add(ev.FirstTokenReceived, **self.scope())
        self.add(ev.FirstDeltaCommitted, **self.scope())
        for batch in range(batches):
            self.add(
                ev.DeltasDelivered,
                **self.scope(),
                from_index=batch * 16,
                to_index=batch * 16 + 16,
                tokens=16,
                text="lorem ipsum dolor sit amet " * 3,
                text_sha256=None,
            )

    def complete(self) -> None:
        self.add(ev.RequestCompleted, finish_reason="stop", usage={"prompt_tokens": 180, "completion_tokens": 256})

    def fail(self, kind: FailureKind) -> list[Any]:
        self.add(ev.UpstreamFailed, **self.scope(), kind=kind, detail=kind.value)
        return self.decide()


def completed(request_id: str, at: datetime, batches: int) -> list[Event]:
    request = Request(request_id, at)
    request.start("w1")
    request.answer(batches)
    request.complete()
    return request.events


def retried(request_id: str, at: datetime, batches: int) -> list[Event]:
    request = Request(request_id, at)
    request.start("w1")
    request.fail(FailureKind.REPLICA_EXITED)
    request.start("w2")
    request.answer(batches)
    request.complete()
    return request.events


def fenced(request_id: str, at: datetime, batches: int) -> list[Event]:
    request = Request(request_id, at)
    request.start("w1")
    request.fail(FailureKind.LIVENESS_UNCERTAIN)
    scope = request.scope()
    request.add(ev.AttemptFenced, **scope, waiting_for="cancel_ack_or_lease_expiry")
    request.add(ev.CancelSent, **scope)
    request.add(ev.CancelAcked, **scope, generated_tokens=3)
    request.add(ev.AttemptReleased, **scope, because=ReleaseReason.CANCEL_ACKED)
    request.decide()
    request.start("w3")
    request.answer(batches)
    request.complete()
    return request.events


def interrupted(request_id: str, at: datetime, batches: int) -> list[Event]:
    request = Request(request_id, at)
    request.start("w1")
    request.answer(batches // 2)
    (failure,) = [a for a in request.fail(FailureKind.REPLICA_EXITED) if isinstance(a, FailRequest)]
    request.add(
        ev.RequestFailed,
        code=failure.code,
        message=failure.message,
        partial_output=True,
        delivered_output_tokens=failure.delivered_output_tokens,
        retryable=False,
    )
    return request.events


MIX: list[tuple[Callable[[str, datetime, int], list[Event]], int]] = [
    (completed, 7),
    (retried, 1),
    (fenced, 1),
    (interrupted, 1),
]


def night(requests: int, batches: int) -> list[list[Event]]:
    shapes = [shape for shape, weight in MIX for _ in range(weight)]
    return [
        shapes[number % len(shapes)](f"req_{number:07d}", T0 + timedelta(seconds=number), batches)
        for number in range(requests)
    ]


def timed(work: Callable[[], object], rounds: int) -> list[float]:
    seconds = []
    for _ in range(rounds):
        started = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - started)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--batches", type=int, default=16, help="delivery batches of a complete answer")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="print where one offline round spends its time")
    args = parser.parse_args()

    streams = night(args.requests, args.batches)
    count = sum(len(events) for events in streams)
    decisions = sum(isinstance(event, ev.Decided) for events in streams for event in events)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "night.jsonl"
        path.write_text("".join(dump_trace([event for events in streams for event in events])))
        size = path.stat().st_size
        lines = path.read_text().splitlines()

    def parse() -> Any:
        return parse_trace(lines)

    def replay_all(parsed: list[list[Event]] = streams) -> None:
        for events in parsed:
            if not replay(events).ok:
                raise SystemExit(f"{events[0].request_id} diverged: the generator is wrong")

    def offline() -> None:
        replay_all(list(parse().requests.values()))

    print(
        f"{args.requests:,} requests, {count:,} events ({decisions:,} decisions), trace {size / 1e6:.1f} MB;"
        f" best and median of {args.rounds} rounds, one core"
    )
    results = {}
    for name, work in (("parse", parse), ("replay", replay_all), ("offline", offline)):
        seconds = timed(work, args.rounds)
        best, median = count / min(seconds), count / statistics.median(seconds)
        results[name] = best
        print(f"  {name:8} {best:>10,.0f} events/s best  {median:>10,.0f} median")
    verdict = "meets" if results["offline"] >= TARGET else "is short of"
    print(f"offline replay {verdict} the target of {TARGET:,} events/s")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(offline)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    return 0 if results["offline"] >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
