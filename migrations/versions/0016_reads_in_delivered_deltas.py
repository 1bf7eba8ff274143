"""A request's delivered deltas are the most any reader was shown, as its tokens are (docs/design.md §15).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06

Why: migration 0015 made ``requests.delivered_output_tokens`` the most any reader was
shown, and left ``delivered_deltas`` what was delivered live, so a background response
read whole after its end showed 16 tokens delivered in 0 deltas. A read after the end is
recorded as ``StreamResumed`` whose ``to_index`` says how many deltas that reader had
(every one before it); the fold keeps the reads' most (``read_deltas``) beside the live
count, which stays where the log's produced tail starts (app/api/resume/log.py), and the
read models take the greater of the two: the general UPDATE here (a ``StreamResumed``
never rides the deliveries-only one) and the bulk projection (app/store/bulk_projection.py).

The projection is written whole, as migration 0014 says every change to it is: 0015's
text with the batch's ``read_deltas`` and the general UPDATE taking the greatest.

Online: ``CREATE OR REPLACE FUNCTION`` takes no lock on the tables. Downgrade puts back
0015's text.
"""

from __future__ import annotations

from alembic import context, op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | None = None
depends_on: str | None = None

# The function's settings, as 0014 gives them (generic plans, no sequential scans).
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
                       -- what a reader after the end was shown (StreamResumed's tokens, migration 0015)
                       max((body->>'tokens')::integer) FILTER (WHERE type = 'StreamResumed') AS read_tokens,
                       -- and how many deltas that reader had (StreamResumed's to_index, migration 0016)
                       max((body->>'to_index')::integer) FILTER (WHERE type = 'StreamResumed') AS read_deltas,
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
                    delivered_deltas = greatest(r.delivered_deltas, c.delivered_deltas, c.read_deltas),
                    delivered_output_tokens = greatest(r.delivered_output_tokens + coalesce(c.delivered_tokens, 0),
                                                       c.read_tokens),
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
    previous = context.script.get_revision("0015")
    assert previous is not None and previous.module is not None
    op.execute(previous.module.PROJECTION)
    op.execute("SELECT phasegate_day_projections()")
