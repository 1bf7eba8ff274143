"""The projection trigger's function written whole: one readable definition.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06

Why: until now no migration held the projection as one text. 0001 wrote it, 0002 wrote
it again, 0007 rewrote 0002's with seventeen ``str.replace`` edits, 0009 patched 0007's
result and 0012 patched 0009's; the function that runs could be read only from a live
database. This migration writes it whole, as 0012 left it: the same statements, token
for token, laid out to be read (``tests/app/store/test_projection_text.py`` holds the
two equal once SQL comments and whitespace are set aside), and with the settings 0009
gave it (generic plans, no sequential scans) in its own definition. The applied
migrations stay as they are.

From here on a migration that changes the projection writes its ``PROJECTION_BODY``
whole, as this one does; the test above holds the live functions' bodies (``prosrc``
of the parent's and of each day's) equal to the latest such text, and fails on a later
migration that edits the function without writing it whole.

Each day's function (``project_request_events_pYYYYMMDD``, migration 0010) is this one
but for the read models it names (``requests_pYYYYMMDD``, ``request_attempts_pYYYYMMDD``):
``phasegate_day_projections()`` makes every open day's again from the parent's.

The bulk loader (app/store/bulk_projection.py) stays a definition of its own, held equal
row for row by tests/app/store/test_bulk.py.

Online: ``CREATE OR REPLACE FUNCTION`` takes no lock on the tables; the next append uses
the new text. Downgrade puts back the text 0012 made (the same statements): 0013, below
this one, makes the fleet's tables and leaves the projection as 0012 left it.
"""

from __future__ import annotations

from alembic import context, op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | None = None
depends_on: str | None = None

# The function's settings: generic plans, pruned to the batch's days as each statement
# starts; and no plan that reads a read model's partition whole, which a plan made on a
# small partition would otherwise pick for a lookup by key (migration 0009).
SETTINGS = "SET plan_cache_mode = force_generic_plan SET enable_seqscan = off"

PROJECTION_BODY = """
-- The read models, projected from each append in its own transaction: a statement
-- trigger over the batch (new_events). In order: the new requests' rows; each request's
-- row with the stream guard (its events in the batch must follow its last version, or
-- the append fails with PG409); the new attempts' rows; the attempts' news; the attempt
-- that completed its request. Each row is found by its whole key, one statement a row.
DECLARE
    has_accepted boolean;
    has_started boolean;
    has_attempt_news boolean;
    has_completed boolean;
    deliveries_only boolean;
    first_day date;  -- the batch's days: computed, read by no statement since 0009
    last_day date;
    streams integer;
    updated integer;
    culprit record;
    c record;
    u record;
    finished record;
    one integer;
BEGIN
    -- one pass to learn which of the steps below this batch needs
    SELECT bool_or(type = 'RequestAccepted'),
           bool_or(type = 'AttemptStarted'),
           bool_or(type IN ('FirstTokenReceived', 'UpstreamFailed', 'AttemptFenced', 'CancelSent',
                            'CancelAcked', 'LeaseExpired', 'AttemptReleased')),
           bool_or(type = 'RequestCompleted'),
           bool_and(type = 'DeltasDelivered'),
           count(DISTINCT request_id), min(accepted_on), max(accepted_on)
      INTO has_accepted, has_started, has_attempt_news, has_completed, deliveries_only, streams, first_day, last_day
      FROM new_events;

    IF has_accepted THEN
        INSERT INTO requests (request_id, tenant, model, model_revision, endpoint, stream,
                              prompt_tokens, n, guided, tools, max_attempts, idempotency_key, seed,
                              gateway, phase, accepted_at, last_event_at, last_seq,
                              accepted_on)
        SELECT request_id, body->>'tenant', body->>'model', body->>'model_revision',
               body->>'endpoint', (body->>'stream')::boolean, (body->>'prompt_tokens')::integer,
               (body->>'n')::integer, (body->>'guided')::boolean, (body->>'tools')::boolean,
               (body->>'max_attempts')::integer, body->>'idempotency_key', (body->>'seed')::bigint,
               body->>'gateway', 'new', occurred_at, occurred_at, 0, accepted_on
          FROM new_events WHERE type = 'RequestAccepted';
    END IF;

    -- The request row, and the stream guard: each request's events in this batch must
    -- start right after its last version. Under READ COMMITTED a concurrent writer's
    -- committed update is re-read before the WHERE is checked, so two writers that
    -- skip past each other are caught too.
    updated := 0;
    IF deliveries_only THEN
        -- Token deliveries, most of the log, move only the counters: a narrow UPDATE.
        FOR c IN
            SELECT request_id, accepted_on,
                   min(version) AS first_version,
                   max(version) AS last_version,
                   count(*) AS events,
                   max(occurred_at) AS last_event_at,
                   max((body->>'to_index')::integer) AS delivered_deltas,
                   sum((body->>'tokens')::integer) AS delivered_tokens
              FROM new_events
             GROUP BY request_id, accepted_on
        LOOP
            UPDATE requests r SET
                delivered_deltas = greatest(r.delivered_deltas, c.delivered_deltas),
                delivered_output_tokens = r.delivered_output_tokens + c.delivered_tokens,
                last_event_at = greatest(r.last_event_at, c.last_event_at),
                last_seq = c.last_version
             WHERE r.request_id = c.request_id AND r.accepted_on = c.accepted_on
               AND r.last_seq = c.first_version - 1
               AND c.last_version - c.first_version + 1 = c.events;
            GET DIAGNOSTICS one = ROW_COUNT;
            updated := updated + one;
        END LOOP;
    ELSE
        -- The phase is the one set by the batch's last phase-changing event, unless an
        -- AttemptReleased came after a fence (fenced -> prefill). "Last" is found without
        -- a sort: max(version * 8 + phase code) carries both the version and the phase.
        FOR c IN
            WITH batch AS (
                SELECT request_id, accepted_on,
                       min(version) AS first_version,
                       max(version) AS last_version,
                       count(*) AS events,
                       bool_and(type = 'DeltasDelivered') AS deliveries_only,
                       max(occurred_at) AS last_event_at,
                       max(version::bigint * 8 + CASE type WHEN 'RequestAccepted' THEN 1
                                                           WHEN 'FirstDeltaCommitted' THEN 2
                                                           WHEN 'AttemptFenced' THEN 3
                                                           ELSE 4 END)
                           FILTER (WHERE type IN ('RequestAccepted', 'FirstDeltaCommitted', 'AttemptFenced',
                                                  'RequestCompleted', 'RequestFailed', 'RequestCancelled'))
                           AS phase_change,
                       max(version) FILTER (WHERE type = 'AttemptReleased') AS released_version,
                       max(attempt) FILTER (WHERE type = 'AttemptStarted') AS attempts,
                       array_agg(body->>'replica_id' ORDER BY version) FILTER (WHERE type = 'AttemptStarted')
                           AS replicas_started,
                       min(attempt) FILTER (WHERE type = 'FirstDeltaCommitted') AS first_delta_attempt,
                       min(occurred_at) FILTER (WHERE type = 'FirstDeltaCommitted') AS first_delta_at,
                       max((body->>'to_index')::integer) FILTER (WHERE type = 'DeltasDelivered') AS delivered_deltas,
                       sum((body->>'tokens')::integer) FILTER (WHERE type = 'DeltasDelivered') AS delivered_tokens,
                       count(*) FILTER (WHERE type = 'ToolCallEmitted') AS tool_calls,
                       count(*) FILTER (WHERE type = 'Decided') AS decisions,
                       min(occurred_at) FILTER (WHERE type = 'ClientDisconnected') AS client_disconnected_at,
                       -- at most one terminal event per request, so min() just picks it
                       min(CASE type WHEN 'RequestCompleted' THEN 'completed' WHEN 'RequestFailed' THEN 'failed'
                                     WHEN 'RequestCancelled' THEN 'cancelled' END) AS outcome,
                       min(coalesce(body->>'code', body->>'reason'))
                           FILTER (WHERE type IN ('RequestFailed', 'RequestCancelled')) AS error_code,
                       min(body->>'message') FILTER (WHERE type = 'RequestFailed') AS error_message,
                       bool_or((body->>'retryable')::boolean) FILTER (WHERE type = 'RequestFailed') AS retryable,
                       min(body->>'finish_reason') FILTER (WHERE type = 'RequestCompleted') AS finish_reason,
                       min((body->'usage')::text) FILTER (WHERE type = 'RequestCompleted') AS usage,
                       min(occurred_at) FILTER (WHERE type IN ('RequestCompleted', 'RequestFailed',
                                                               'RequestCancelled')) AS finished_at
                  FROM new_events
                 GROUP BY request_id, accepted_on
            ), changes AS (
                SELECT batch.*,
                       (ARRAY['prefill', 'decode', 'fenced', 'terminated'])[phase_change % 8] AS set_phase,
                       coalesce(phase_change / 8, 0) AS set_phase_version
                  FROM batch
            )
            SELECT * FROM changes
        LOOP
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
                    phase = CASE WHEN coalesce(c.set_phase, r.phase) = 'fenced'
                                      AND c.released_version > c.set_phase_version
                                 THEN 'prefill' ELSE coalesce(c.set_phase, r.phase) END,
                    attempts = greatest(r.attempts, c.attempts),
                    first_delta_attempt = coalesce(r.first_delta_attempt, c.first_delta_attempt),
                    first_delta_at = coalesce(r.first_delta_at, c.first_delta_at),
                    delivered_deltas = greatest(r.delivered_deltas, c.delivered_deltas),
                    delivered_output_tokens = r.delivered_output_tokens + coalesce(c.delivered_tokens, 0),
                    tool_calls = r.tool_calls + c.tool_calls,
                    decisions = r.decisions + c.decisions,
                    replicas_tried = r.replicas_tried || coalesce(c.replicas_started, '{}'),
                    client_disconnected_at = coalesce(r.client_disconnected_at, c.client_disconnected_at),
                    outcome = coalesce(r.outcome, c.outcome),
                    error_code = coalesce(r.error_code, c.error_code),
                    error_message = coalesce(r.error_message, c.error_message),
                    retryable = coalesce(r.retryable, c.retryable),
                    finish_reason = coalesce(r.finish_reason, c.finish_reason),
                    usage = coalesce(r.usage, c.usage::jsonb),
                    finished_at = coalesce(r.finished_at, c.finished_at),
                    ttft_ms = coalesce(r.ttft_ms, milliseconds(c.first_delta_at - r.accepted_at)),
                    duration_ms = coalesce(r.duration_ms, milliseconds(c.finished_at - r.accepted_at)),
                    decode_ms = coalesce(r.decode_ms,
                                         milliseconds(c.finished_at - coalesce(r.first_delta_at, c.first_delta_at))),
                    last_event_at = greatest(r.last_event_at, c.last_event_at),
                    last_seq = c.last_version
                 WHERE r.request_id = c.request_id AND r.accepted_on = c.accepted_on
                   AND r.last_seq = c.first_version - 1
                   AND c.last_version - c.first_version + 1 = c.events;
            END IF;
            GET DIAGNOSTICS one = ROW_COUNT;
            updated := updated + one;
        END LOOP;
    END IF;
    IF updated <> streams THEN
        SELECT e.request_id, min(e.version) AS first_version, max(r.last_seq) AS last_seq
          INTO culprit
          FROM new_events e LEFT JOIN requests r USING (request_id)
         GROUP BY e.request_id
        HAVING max(r.last_seq) IS DISTINCT FROM max(e.version)
         LIMIT 1;
        RAISE EXCEPTION 'request % : version % does not follow the stream''s last version %',
              culprit.request_id, culprit.first_version, coalesce(culprit.last_seq, 0)
              USING ERRCODE = 'PG409';
    END IF;

    IF has_started THEN
        INSERT INTO request_attempts
               (request_id, attempt, lease_epoch, replica_id, started_at, lease_expires_at, accepted_on)
        SELECT request_id, attempt, lease_epoch, body->>'replica_id', occurred_at,
               (body->>'lease_expires_at')::timestamptz, accepted_on
          FROM new_events WHERE type = 'AttemptStarted';
    END IF;

    IF has_attempt_news THEN
        FOR u IN
            SELECT request_id, accepted_on, attempt,
                   min(occurred_at) FILTER (WHERE type = 'FirstTokenReceived') AS first_token_at,
                   (array_agg(body ORDER BY version DESC) FILTER (WHERE type = 'UpstreamFailed'))[1]
                       AS failure,
                   (array_agg(occurred_at ORDER BY version DESC) FILTER (WHERE type = 'UpstreamFailed'))[1]
                       AS failed_at,
                   min(occurred_at) FILTER (WHERE type = 'AttemptFenced') AS fenced_at,
                   min(body->>'waiting_for') FILTER (WHERE type = 'AttemptFenced') AS waiting_for,
                   min(occurred_at) FILTER (WHERE type = 'CancelSent') AS cancel_sent_at,
                   min(occurred_at) FILTER (WHERE type = 'CancelAcked') AS cancel_acked_at,
                   min((body->>'generated_tokens')::integer) FILTER (WHERE type = 'CancelAcked')
                       AS generated_tokens,
                   min(occurred_at) FILTER (WHERE type = 'LeaseExpired') AS lease_expired_at,
                   min(occurred_at) FILTER (WHERE type = 'AttemptReleased') AS released_at,
                   min(body->>'because') FILTER (WHERE type = 'AttemptReleased') AS released_because
              FROM new_events
             WHERE type IN ('FirstTokenReceived', 'UpstreamFailed', 'AttemptFenced', 'CancelSent',
                            'CancelAcked', 'LeaseExpired', 'AttemptReleased')
             GROUP BY request_id, accepted_on, attempt
        LOOP
            UPDATE request_attempts a SET
                first_token_at = coalesce(a.first_token_at, u.first_token_at),
                -- a later failure replaces the earlier one, nulls included, as fold does
                failure_kind = CASE WHEN u.failure IS NULL THEN a.failure_kind ELSE u.failure->>'kind' END,
                failure_detail = CASE WHEN u.failure IS NULL THEN a.failure_detail ELSE u.failure->>'detail' END,
                failure_deadline = CASE WHEN u.failure IS NULL THEN a.failure_deadline
                                        ELSE u.failure->>'deadline' END,
                upstream_status = CASE WHEN u.failure IS NULL THEN a.upstream_status
                                       ELSE (u.failure->>'upstream_status')::integer END,
                upstream_code = CASE WHEN u.failure IS NULL THEN a.upstream_code
                                     ELSE u.failure->>'upstream_code' END,
                failed_at = coalesce(u.failed_at, a.failed_at),
                fenced_at = coalesce(a.fenced_at, u.fenced_at),
                waiting_for = coalesce(a.waiting_for, u.waiting_for),
                cancel_sent_at = coalesce(a.cancel_sent_at, u.cancel_sent_at),
                cancel_acked_at = coalesce(a.cancel_acked_at, u.cancel_acked_at),
                generated_tokens = coalesce(a.generated_tokens, u.generated_tokens),
                lease_expired_at = coalesce(a.lease_expired_at, u.lease_expired_at),
                released_at = coalesce(a.released_at, u.released_at),
                released_because = coalesce(a.released_because, u.released_because),
                fence_ms = coalesce(a.fence_ms, milliseconds(u.released_at - coalesce(a.fenced_at, u.fenced_at)))
             WHERE a.request_id = u.request_id AND a.attempt = u.attempt AND a.accepted_on = u.accepted_on;
        END LOOP;
    END IF;

    IF has_completed THEN
        -- the running attempt completed the request (fold: the current attempt)
        FOR finished IN SELECT request_id, accepted_on, occurred_at FROM new_events
                         WHERE type = 'RequestCompleted' LOOP
            UPDATE request_attempts a SET completed_at = finished.occurred_at
              FROM requests r
             WHERE r.request_id = finished.request_id AND r.accepted_on = finished.accepted_on
               AND a.request_id = finished.request_id AND a.accepted_on = finished.accepted_on
               AND a.attempt = r.attempts;
        END LOOP;
    END IF;
    RETURN NULL;
END
"""

PROJECTION = (
    "CREATE OR REPLACE FUNCTION project_request_events() RETURNS trigger LANGUAGE plpgsql\n"
    f"{SETTINGS}\n"
    f"AS $fn${PROJECTION_BODY}$fn$"
)


def upgrade() -> None:
    op.execute(PROJECTION)
    op.execute("SELECT phasegate_day_projections()")  # every open day's, from the parent's


def downgrade() -> None:
    previous = context.script.get_revision("0012")
    assert previous is not None and previous.module is not None
    previous.module.upgrade()
