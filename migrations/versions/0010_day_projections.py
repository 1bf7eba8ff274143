"""Each day's partition of the log projects into that day's read models alone.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05

Why: the projection trigger's statements run on generic plans over the partitioned read
models (0007, 0009), and PostgreSQL locks every partition such a plan names each time
it runs, before it prunes the other days: an append costs more the more days are kept.
With a year kept (367 partitions) the commit point's append took +98 µs and a delivery's
+51 µs over four days, even with 1,024 lock slots (docs/scaling.md, "Lock slots").

Now each day's partition of ``request_events`` carries the projection as statement
triggers of its own, in functions whose statements name that day's partitions of
``requests`` and ``request_attempts`` and nothing else, and the writer appends a batch of
one day straight into that day's partition (app/store/insert.py). A statement trigger
fires for the table the statement names, so an append through the parent (a batch of
several days, a request in the legacy partition, the previous release, a day whose
triggers are not there yet) still runs the parent's triggers, as before. What the log
guards is the same on both ways in: the day's function is the parent's, word for word
but for the tables it names, and the instance guard is the same function.

- ``phasegate_day_projection(day)`` makes a day's function, ``project_request_events_pYYYYMMDD``,
  from the parent's live definition (``pg_get_functiondef``), and its two triggers,
  where they are not made already: a day whose function and triggers are as they
  should be is left alone (no lock taken, no plan made again), and so is a day closed
  for retention. The parent's function is the one definition; a migration that changes
  it calls ``phasegate_day_projections()``, which makes every open day's again
  (``tests/app/store/test_day_projection.py`` holds each day's equal to the parent's).
- ``phasegate_close_day(day)`` replaces a day's function by one that refuses every
  append, as the parent refuses a row whose day has no partition (SQLSTATE 23514).
  Retention closes a day before it detaches any of its partitions, so that no append
  reaches a log partition whose read models are already detached.
- ``phasegate db maintain`` makes a new day's triggers once its four partitions are
  attached, and drops a day's function once its partition is dropped
  (app/store/partitions.py).

PostgreSQL before 17 gets no day triggers (an INSERT into a partition there does not
take the parent's identity for ``position``): its appends go through the parent as before.

Online: each day's ``CREATE TRIGGER`` takes ``SHARE ROW EXCLUSIVE`` on that day's log
partition for a moment (appends to the day wait milliseconds); nothing is rewritten.
"""

from __future__ import annotations

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | None = None
depends_on: str | None = None

DAY_PROJECTION = r"""
CREATE OR REPLACE FUNCTION phasegate_day_projection(day date) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    suffix text := to_char(day, '"_p"YYYYMMDD');
    events regclass := to_regclass('request_events' || suffix);
    projection text := 'project_request_events' || suffix;
    definition text := pg_get_functiondef('project_request_events()'::regprocedure);
    made regprocedure;
BEGIN
    IF events IS NULL OR current_setting('server_version_num')::integer < 170000 THEN
        RETURN;  -- a day in the legacy partition, or a server whose partitions lack the identity
    END IF;
    definition := regexp_replace(definition, '\mrequests\M', 'requests' || suffix, 'g');
    definition := regexp_replace(definition, '\mrequest_attempts\M', 'request_attempts' || suffix, 'g');
    definition := replace(definition, 'project_request_events()', projection || '()');
    made := to_regprocedure(projection || '()');
    -- what is made already is left alone (no lock, no plan made again), and so is a
    -- day closed for retention (phasegate_close_day)
    IF made IS NULL OR (pg_get_functiondef(made) <> definition
                        AND pg_get_functiondef(made) NOT LIKE '%phasegate: closed%') THEN
        EXECUTE definition;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = events AND tgname = 'request_events_project_day') THEN
        EXECUTE format('CREATE TRIGGER request_events_project_day AFTER INSERT ON %s'
                       ' REFERENCING NEW TABLE AS new_events FOR EACH STATEMENT EXECUTE FUNCTION %I()',
                       events, projection);
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = events AND tgname = 'request_events_guard_day') THEN
        EXECUTE format('CREATE TRIGGER request_events_guard_day BEFORE INSERT ON %s'
                       ' FOR EACH STATEMENT EXECUTE FUNCTION guard_instance_lease()', events);
    END IF;
END
$$
"""

DAY_PROJECTIONS = """
CREATE OR REPLACE FUNCTION phasegate_day_projections() RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    made integer := 0;
    partition record;
BEGIN
    FOR partition IN
        SELECT to_date(substring(c.relname FROM '_p([0-9]{8})$'), 'YYYYMMDD') AS day
          FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'request_events'::regclass AND NOT i.inhdetachpending
           AND c.relname ~ '^request_events_p[0-9]{8}$'
    LOOP
        PERFORM phasegate_day_projection(partition.day);
        made := made + 1;
    END LOOP;
    RETURN made;
END
$$
"""

CLOSE_DAY = """
CREATE OR REPLACE FUNCTION phasegate_close_day(day date) RETURNS void
LANGUAGE plpgsql AS $close$
DECLARE
    projection text := 'project_request_events' || to_char(day, '"_p"YYYYMMDD');
BEGIN
    IF to_regprocedure(projection || '()') IS NULL THEN
        RETURN;
    END IF;
    EXECUTE format($f$CREATE OR REPLACE FUNCTION %I() RETURNS trigger LANGUAGE plpgsql AS $body$
BEGIN  -- phasegate: closed
    RAISE EXCEPTION 'no partition of relation "request_events" found for row'
          USING ERRCODE = 'check_violation', DETAIL = %L;
END
$body$$f$, projection, format('day %s is past retention: its partitions are being dropped', day));
END
$close$
"""

# the day triggers and functions made so far, dropped (a downgrade)
DROP_DAYS = """
DO $$
DECLARE
    made record;
BEGIN
    FOR made IN SELECT tgrelid::regclass AS events, tgname FROM pg_trigger
                 WHERE tgname IN ('request_events_project_day', 'request_events_guard_day') LOOP
        EXECUTE format('DROP TRIGGER %I ON %s', made.tgname, made.events);
    END LOOP;
    FOR made IN SELECT p.oid::regprocedure AS function FROM pg_proc p
                 WHERE p.proname ~ '^project_request_events_p[0-9]{8}$' LOOP
        EXECUTE format('DROP FUNCTION %s', made.function);
    END LOOP;
END
$$
"""


def upgrade() -> None:
    for function in (DAY_PROJECTION, DAY_PROJECTIONS, CLOSE_DAY):
        op.execute(function)
    op.execute("SELECT phasegate_day_projections()")


def downgrade() -> None:
    op.execute(DROP_DAYS)
    for function in ("phasegate_day_projections()", "phasegate_day_projection(date)", "phasegate_close_day(date)"):
        op.execute(f"DROP FUNCTION {function}")
