"""What a plain request's events cost the gateway's Python, event by event.

    python -m ops.bench.request_events [--number 20000] [--tokens 32]

The events of one plain streamed request as the driver records them (accepted, the
placement decided, the attempt started, its first token, the first delta committed,
its deliveries in batches of ``delivery_batch_tokens`` (16), completed and released:
``ops/traces.completed``), each taken through the steps the recorder and the store run
for it, timed apart:

- **stamp and fold**: ``statemachine.state.advance``, which builds the event with the
  next seq and applies it to the request's state (the transition table, the
  invariants, the handler, a new frozen state);
- **decide**: ``statemachine.policy.decide`` on the state after it (the driver skips
  it on a state it already decided nothing on, so this is the most it costs);
- **encode**: ``app.store.codec.to_row``, the row the writer sends (the body's JSON).

Prints microseconds an event (the median of ``--number`` runs in five repetitions) and
each step's sum over the request. The append itself, PostgreSQL's share included, is
``ops/bench/commit_point.py``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import timeit
from collections.abc import Callable
from datetime import date

from app.store.codec import to_row
from ops import traces
from statemachine.events import Event
from statemachine.policy import decide
from statemachine.policy_config import PolicyConfig
from statemachine.request_state import RequestState
from statemachine.state import advance, apply

STEPS = ("stamp and fold", "decide", "encode")
BATCH_TOKENS = 16  # the gateway's delivery_batch_tokens


def plain_request(tokens: int) -> list[Event]:
    """A plain streamed request's events, its deliveries in batches as the recorder closes them."""
    batches = [min(BATCH_TOKENS, tokens - start) for start in range(0, tokens, BATCH_TOKENS)]
    trace = traces.Trace("req_bench").start("w1").first_token(20.0).first_delta()
    for size in batches:
        trace.deliver("tok" * size, tokens=size)
    return list(trace.completed().events)


def fields_of(event: Event) -> dict[str, object]:
    stamped = {"request_id", "seq", "occurred_at"}
    return {f.name: getattr(event, f.name) for f in dataclasses.fields(event) if f.name not in stamped}


def microseconds(work: Callable[[], object], number: int) -> float:
    return statistics.median(timeit.repeat(work, number=number, repeat=5)) / number * 1e6


def steps_of(before: RequestState, event: Event, day: date, number: int) -> dict[str, float]:
    """``event``'s steps' microseconds, recorded on ``before`` (a request accepted on ``day``)."""
    after = apply(before, event)
    cls, at, fields = type(event), event.occurred_at, fields_of(event)
    config = PolicyConfig()
    return {
        "stamp and fold": microseconds(lambda: advance(before, cls, at, **fields), number),
        "decide": microseconds(lambda: decide(after, config), number),
        "encode": microseconds(lambda: to_row(event, day), number),
    }


def measure(events: list[Event], number: int) -> list[tuple[str, dict[str, float]]]:
    """Each event's type and its steps' microseconds."""
    day = to_row(events[0]).accepted_on  # the RequestAccepted's own
    assert day is not None
    found = []
    state = RequestState(request_id=events[0].request_id)
    for event in events:
        found.append((type(event).__name__, steps_of(state, event, day, number)))
        state = apply(state, event)
    return found


def report(found: list[tuple[str, dict[str, float]]], tokens: int) -> None:
    print(f"a plain streamed request of {tokens} tokens: {len(found)} events; microseconds an event")
    print(f"  {'event':<22}" + "".join(f"{step:>16}" for step in STEPS))
    for name, steps in found:
        print(f"  {name:<22}" + "".join(f"{steps[step]:16.2f}" for step in STEPS))
    totals = {step: sum(steps[step] for _, steps in found) for step in STEPS}
    print(f"  {'the request':<22}" + "".join(f"{totals[step]:16.2f}" for step in STEPS))
    print(f"  all steps: {sum(totals.values()):.1f} us a request")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    report(measure(plain_request(args.tokens), args.number), args.tokens)


if __name__ == "__main__":
    main()
