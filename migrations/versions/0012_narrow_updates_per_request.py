"""A request whose events in a batch are deliveries only gets the narrow UPDATE, whatever
the rest of the batch holds.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05

Why: the projection trigger chose between its two updates of ``requests`` once a batch:
the narrow one (the delivery counters, ``last_event_at``, ``last_seq``) only when every
event of the batch was a ``DeltasDelivered``, else the general one (every column of the
row) for each request in it. At 100 streams a writer's batch holds ~17 requests, so it
is almost never deliveries only, and a request's delivery batches, most of its appends,
went through the general UPDATE (36,945 general updates against 4,966 narrow ones for
5,102 requests: docs/performance.md). Each of those statements sets up all its
expressions before it runs (a perf profile of PostgreSQL put 12 % of its CPU in the
trigger's executor start). Now the choice is made a request at a time: the batch's
aggregate says whether the request's own events are deliveries only. For such a
request the general UPDATE sets every other column to what it was, so the row is the
same either way; ``tests/app/store/test_read_models.py`` holds the read models equal
to the fold over batches of every shape. Measured: an append's statements 457-463 µs a
request against 485-486 (``ops/bench/studies/windowed_projection.py``'s batches, side by side).

The parent's function is made again and so is every open day's
(``phasegate_day_projections()``, migration 0010); the stream guard is the same
condition in both updates.

Online: ``CREATE OR REPLACE FUNCTION`` takes no lock on the tables; the next append uses
the new definition.
"""

from __future__ import annotations

from alembic import context, op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | None = None
depends_on: str | None = None

# in the general update's aggregate: whether the request's events in the batch are deliveries only
_AGGREGATE = (
    "                       count(*) AS events,\n"
    "                       max(occurred_at) AS last_event_at,\n"
    "                       max(version::bigint",
    "                       count(*) AS events,\n"
    "                       bool_and(type = 'DeltasDelivered') AS deliveries_only,\n"
    "                       max(occurred_at) AS last_event_at,\n"
    "                       max(version::bigint",
)
_GENERAL_UPDATE = "        LOOP\n            UPDATE requests r SET\n                phase = CASE"
_NARROW_UPDATE = """        LOOP
            IF c.deliveries_only THEN
                UPDATE requests r SET
                    delivered_deltas = greatest(r.delivered_deltas, c.delivered_deltas),
                    delivered_output_tokens = r.delivered_output_tokens + c.delivered_tokens,
                    last_event_at = greatest(r.last_event_at, c.last_event_at),
                    last_seq = c.last_version
                 WHERE r.request_id = c.request_id AND r.accepted_on = c.accepted_on
                   AND r.last_seq = c.first_version - 1
                   AND c.last_version - c.first_version + 1 = c.events;
            ELSE
            UPDATE requests r SET
                phase = CASE"""
_GENERAL_TAIL = (
    """               AND c.last_version - c.first_version + 1 = c.events;
            GET DIAGNOSTICS one = ROW_COUNT;
            updated := updated + one;
        END LOOP;
    END IF;""",
    """               AND c.last_version - c.first_version + 1 = c.events;
            END IF;
            GET DIAGNOSTICS one = ROW_COUNT;
            updated := updated + one;
        END LOOP;
    END IF;""",
)


def _previous() -> object:
    previous = context.script.get_revision("0009")
    assert previous is not None and previous.module is not None
    return previous.module


def projection() -> str:
    """0009's projection, the narrow UPDATE chosen a request at a time (the module docstring)."""
    function: str = _previous().projection()  # type: ignore[attr-defined]
    for old, new in (_AGGREGATE, (_GENERAL_UPDATE, _NARROW_UPDATE), _GENERAL_TAIL):
        assert function.count(old) == 1, f"0009's projection changed near {old!r}"
        function = function.replace(old, new)
    return function


def _made(function: str) -> None:
    op.execute(function)
    op.execute(_previous()._PLANS)  # type: ignore[attr-defined]  # CREATE OR REPLACE resets its settings
    op.execute("SELECT phasegate_day_projections()")


def upgrade() -> None:
    _made(projection())


def downgrade() -> None:
    _made(_previous().projection())  # type: ignore[attr-defined]
