"""A request's delivered tokens are the most any reader was shown (docs/design.md §15).

Revision ID: 0014
Revises: 0012
Create Date: 2026-12-06

Why: a background response read after its end (a poll, or a stream from the log) showed
its client every token, and ``requests.delivered_output_tokens`` kept what was delivered
live (none, or what an earlier poll showed). A read after the end is recorded as
``StreamResumed`` with ``tokens``, the output tokens of every delta that reader then had;
the fold takes the most of those and of the live deliveries, and so does the general
UPDATE of the projection here (a ``StreamResumed`` never rides the deliveries-only one),
as the bulk projection does (app/store/bulk_projection.py). ``delivered_deltas`` stays what
was delivered live. (Numbered past 0013, which another change takes: its down revision
names the head it follows.)

Online: ``CREATE OR REPLACE FUNCTION`` takes no lock on the tables.
"""

from __future__ import annotations

from alembic import context

revision: str = "0014"
down_revision: str | None = "0012"
branch_labels: str | None = None
depends_on: str | None = None

_AGGREGATE = (
    "sum((body->>'tokens')::integer) FILTER (WHERE type = 'DeltasDelivered') AS delivered_tokens,",
    "sum((body->>'tokens')::integer) FILTER (WHERE type = 'DeltasDelivered') AS delivered_tokens,\n"
    "                       max((body->>'tokens')::integer) FILTER (WHERE type = 'StreamResumed') AS read_tokens,",
)
_GENERAL = (
    "delivered_output_tokens = r.delivered_output_tokens + coalesce(c.delivered_tokens, 0),",
    "delivered_output_tokens = greatest(r.delivered_output_tokens + coalesce(c.delivered_tokens, 0), c.read_tokens),",
)


def _previous() -> object:
    """0012, whose projection this one changes (whatever revision it follows in the chain)."""
    previous = context.script.get_revision("0012")
    assert previous is not None and previous.module is not None
    return previous.module


def projection() -> str:
    """The previous projection, its general UPDATE taking the most any reader was shown."""
    function: str = _previous().projection()  # type: ignore[attr-defined]
    for old, new in (_AGGREGATE, _GENERAL):
        assert function.count(old) == 1, f"the projection changed near {old!r}"
        function = function.replace(old, new)
    return function


def upgrade() -> None:
    _previous()._made(projection())  # type: ignore[attr-defined]


def downgrade() -> None:
    _previous()._made(_previous().projection())  # type: ignore[attr-defined]
