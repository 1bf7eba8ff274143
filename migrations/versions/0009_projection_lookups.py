"""The projection trigger updates each read-model row by its key, one statement a row.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02

Why: 0007's trigger runs on generic plans (``force_generic_plan``), made at a
connection's first append and made again only when a table's statistics change. Its
updates joined a batch to ``requests`` or ``request_attempts`` in one statement each,
and PostgreSQL chose how from what the tables held at that moment. On an empty log
(the writer's first batches), and again on a day's first rows once autovacuum had
analyzed them (a minute in), it chose to read the whole day's partition for every
batch, and kept that plan while the day grew, until the next ANALYZE. On the per-token
bench (100 streams, one gateway process) PostgreSQL's CPU per 1,000 forwarded tokens
went from 0.019 to 0.047 s over a minute on a fresh log, and from 0.053 to 0.100 s in
ten seconds where autovacuum had analyzed the first hundred requests: the writer's
backend took 65 % of a core, and the gateway served 276-332 requests a second where it
serves ~400-460 without it (docs/performance.md, round 8).

Now every update of a read model is a loop over the batch's rows for it (a request's
counters and phase, an attempt's news, a completion), each row updated by a statement
that names its whole key (``request_id``, ``accepted_on``, and ``attempt``: the unique
index of each day's partition, pruned to the day as the statement starts). What each
sets is unchanged, and so is the stream guard (the rows updated, summed, against the
batch's requests). The function also plans without sequential scans: a lookup by key
is then an index scan even on a partition that the statistics say is tiny, where
PostgreSQL would otherwise read the few pages it was told of, and go on reading them
as the day grows. The batch's own scans (``new_events``, a tuplestore) are not
affected.

Measured: each row's update ~15-50 µs; PostgreSQL's CPU per 1,000 tokens on the same
bench 0.020-0.022 s, flat, in both cases above. Forcing nested loops on the
statements as they were (no hash or merge join, material or memoize) kept a plan that
reads an attempt partition whole in the second case (36 ms a batch), so the per-row
form is what holds.

``tests/app/store/test_projection_plans.py`` makes the plans on an empty log, and on
a day's first rows after ANALYZE, grows the day, and reads the plan of every
statement the trigger ran: no read model's partition is read whole.
"""

from __future__ import annotations

from alembic import context, op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | None = None
depends_on: str | None = None

# The stream guard of both updates of requests: the batch's events of a request must
# start right after its last version.
_GUARD = """         WHERE r.request_id = c.request_id AND r.accepted_on = c.accepted_on
           AND r.accepted_on BETWEEN first_day AND last_day
           AND r.last_seq = c.first_version - 1
           AND c.last_version - c.first_version + 1 = c.events;
"""
_GUARD_BY_KEY = """             WHERE r.request_id = c.request_id AND r.accepted_on = c.accepted_on
               AND r.last_seq = c.first_version - 1
               AND c.last_version - c.first_version + 1 = c.events;
            GET DIAGNOSTICS one = ROW_COUNT;
            updated := updated + one;
        END LOOP;
"""
_UPDATE_REQUESTS = "        UPDATE requests r SET\n"
_DELIVERIES_FROM = "          FROM (SELECT request_id, accepted_on,\n"
_DELIVERIES_SOURCE_END = ") c\n"
_CHANGES_HEAD = "        WITH batch AS (\n"
_CHANGES_FROM = "          FROM changes c\n"
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
# the loops' rows and counts, named apart from the other statements' aliases (the culprit query's e)
_DECLARED = (
    "    culprit record;\n",
    "    culprit record;\n    c record;\n    u record;\n    finished record;\n    one integer;\n",
)
_COUNTED = ("    GET DIAGNOSTICS updated = ROW_COUNT;\n", "")
_COUNT_FROM_ZERO = ("    IF deliveries_only THEN\n", "    updated := 0;\n    IF deliveries_only THEN\n")
# 0007's generic plans, pruned to the batch's days as each statement starts; and no plan
# that reads a read model's partition whole, which a plan made on a small partition
# (autovacuum analyzes a day's first rows) would otherwise pick for a lookup by key.
_PLANS = "ALTER FUNCTION project_request_events() SET plan_cache_mode = force_generic_plan SET enable_seqscan = off"
_PREVIOUS_PLANS = "ALTER FUNCTION project_request_events() SET plan_cache_mode = force_generic_plan"


def _indented(text: str, spaces: int) -> str:
    return "".join(" " * spaces + line if line.strip() else line for line in text.splitlines(True))


def _replaced_once(function: str, old: str, new: str) -> str:
    assert function.count(old) == 1, f"0007's projection changed near {old!r}"
    return function.replace(old, new)


def _previous_projection() -> str:
    previous = context.script.get_revision("0007")
    assert previous is not None and previous.module is not None
    function: str = previous.module._project_events()
    return function


def _requests_by_key(function: str, head: int, source: str, assignments: str, rest: int) -> str:
    """``function`` with the update of requests between ``head`` and its guard (at
    ``rest``) made a loop over ``source``'s rows, each updating its request by key."""
    assert function.startswith(_GUARD, rest), "0007's projection changed near the stream guard"
    by_key = (
        "        FOR c IN\n"
        f"{source}"
        "        LOOP\n"
        "            UPDATE requests r SET\n"
        f"{_indented(assignments, 4)}"
        f"{_GUARD_BY_KEY}"
    )
    return function[:head] + by_key + function[rest + len(_GUARD) :]


def projection() -> str:
    """0007's projection with each of its updates of a read model made a loop of
    updates by key (the module docstring)."""
    function = _previous_projection()
    # deliveries only: UPDATE requests r SET … FROM (SELECT … ) c WHERE <guard>
    head = function.index(_UPDATE_REQUESTS)
    source = function.index(_DELIVERIES_FROM, head)
    end = function.index(_DELIVERIES_SOURCE_END, source)
    assignments = function[head + len(_UPDATE_REQUESTS) : source]
    select = " " * 12 + function[source + len("          FROM (") : end] + "\n"
    function = _requests_by_key(function, head, select, assignments, end + len(_DELIVERIES_SOURCE_END))
    # the others: WITH batch AS (…), changes AS (…) UPDATE requests r SET … FROM changes c WHERE <guard>
    head = function.index(_CHANGES_HEAD)
    update = function.index(_UPDATE_REQUESTS, head)
    source_end = function.index(_CHANGES_FROM, update)
    changes = _indented(function[head:update], 4) + "            SELECT * FROM changes\n"
    assignments = function[update + len(_UPDATE_REQUESTS) : source_end]
    function = _requests_by_key(function, head, changes, assignments, source_end + len(_CHANGES_FROM))
    # the attempts' news: UPDATE request_attempts a SET … FROM (SELECT … ) u WHERE <key>
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
    function = _replaced_once(function, _COMPLETED, _COMPLETED_BY_KEY)
    for old, new in (_DECLARED, _COUNTED, _COUNT_FROM_ZERO):
        function = _replaced_once(function, old, new)
    return function


def upgrade() -> None:
    op.execute(projection())
    op.execute(_PLANS)  # CREATE OR REPLACE FUNCTION resets the function's settings


def downgrade() -> None:
    op.execute(_previous_projection())
    op.execute(_PREVIOUS_PLANS)
