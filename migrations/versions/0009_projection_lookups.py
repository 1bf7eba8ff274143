"""The projection updates each attempt row it must by its key, one statement a row.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02

Why: 0007's trigger runs on generic plans (``force_generic_plan``), made once per
connection at its first append and kept. Two of its statements joined the batch to
``request_attempts`` (and, for a completion, to ``requests``) in one statement each, and
PostgreSQL chose how from what the tables held when the plan was made: on a new log
(empty tables; and a first batch of many events) it chose to read the whole day's
partition for every batch, and kept that plan as the day grew. The writer's connection
makes its plans at the gateway's first append, so a fresh log got slower with every
request until autovacuum's first ANALYZE of the partition made PostgreSQL plan again,
a minute or more later: on the issue-12 bench, PostgreSQL's CPU per 1,000 forwarded
tokens went from 0.019 to 0.047 s over a minute at 100 streams (docs/performance.md,
round 8), and an append of 20 requests' events took 17 ms against 8 ms now once the
day held 20,000 requests.

Now each attempt the batch touches is updated by a statement that names its whole key
(``request_id``, ``attempt``, ``accepted_on``: the unique index of each day's
partition, pruned to the day as the statement starts), in a loop over the batch's
attempts, so the plan is an index lookup whatever the tables held when it was made.
The attempts a batch touches are few (the first token, the release, a completion),
and each lookup costs ~15 µs. What each statement sets is unchanged.

The statements that update ``requests`` stay set-based: their batch side filters on
the stream guard's aggregates, which PostgreSQL estimates at one row, so it looks the
requests up by key from an empty table on (``tests/app/store/test_projection_plans.py``
holds every statement of the trigger to index lookups).
"""

from __future__ import annotations

from alembic import context, op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | None = None
depends_on: str | None = None

_NEWS_HEAD = """    IF has_attempt_news THEN
        UPDATE request_attempts a SET
"""
_NEWS_FROM = """          FROM (
            SELECT request_id, accepted_on, attempt,
"""
_NEWS_TAIL = """          ) u
         WHERE a.request_id = u.request_id AND a.attempt = u.attempt AND a.accepted_on = u.accepted_on
           AND a.accepted_on BETWEEN first_day AND last_day;
    END IF;
"""
_COMPLETED = """        UPDATE request_attempts a SET completed_at = e.occurred_at
          FROM new_events e JOIN requests r USING (request_id, accepted_on)
         WHERE e.type = 'RequestCompleted' AND a.request_id = e.request_id AND a.attempt = r.attempts \
AND a.accepted_on = e.accepted_on
           AND a.accepted_on BETWEEN first_day AND last_day
           AND r.accepted_on BETWEEN first_day AND last_day;
"""
_COMPLETED_BY_KEY = """        FOR finished IN SELECT request_id, accepted_on, occurred_at FROM new_events
                         WHERE type = 'RequestCompleted' LOOP
            UPDATE request_attempts a SET completed_at = finished.occurred_at
              FROM requests r
             WHERE r.request_id = finished.request_id AND r.accepted_on = finished.accepted_on
               AND a.request_id = finished.request_id AND a.accepted_on = finished.accepted_on
               AND a.attempt = r.attempts;
        END LOOP;
"""
# As 0007 sets it: its generic plans are pruned to the batch's days as each statement starts.
_GENERIC_PLANS = "ALTER FUNCTION project_request_events() SET plan_cache_mode = force_generic_plan"


def _indented(text: str, spaces: int) -> str:
    return "".join(" " * spaces + line if line.strip() else line for line in text.splitlines(True))


def _previous_projection() -> str:
    previous = context.script.get_revision("0007")
    assert previous is not None and previous.module is not None
    function: str = previous.module._project_events()
    return function


def projection() -> str:
    """0007's projection with its two attempt updates made one keyed statement a row."""
    function = _previous_projection()
    head = function.index(_NEWS_HEAD)
    source = function.index(_NEWS_FROM, head)
    tail = function.index(_NEWS_TAIL, source)
    assignments = function[head + len(_NEWS_HEAD) : source]
    news = function[source + len("          FROM (\n") : tail]
    by_key = (
        "    IF has_attempt_news THEN\n"
        "        FOR u IN\n"
        f"{news}"
        "        LOOP\n"
        "            UPDATE request_attempts a SET\n"
        f"{_indented(assignments, 4)}"
        "             WHERE a.request_id = u.request_id AND a.attempt = u.attempt AND a.accepted_on = u.accepted_on;\n"
        "        END LOOP;\n"
        "    END IF;\n"
    )
    function = function[:head] + by_key + function[tail + len(_NEWS_TAIL) :]
    # the loops' rows, named apart from the aliases of the other statements (the culprit query's e)
    records = ("    culprit record;\n", "    culprit record;\n    u record;\n    finished record;\n")
    for old, new in ((_COMPLETED, _COMPLETED_BY_KEY), records):
        assert function.count(old) == 1, f"0007's projection changed near {old!r}"
        function = function.replace(old, new)
    return function


def upgrade() -> None:
    op.execute(projection())
    op.execute(_GENERIC_PLANS)  # CREATE OR REPLACE FUNCTION resets the function's settings


def downgrade() -> None:
    op.execute(_previous_projection())
    op.execute(_GENERIC_PLANS)
