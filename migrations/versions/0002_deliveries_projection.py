"""The projection takes a narrow path for batches of token deliveries only.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

Token deliveries are most of the log and move only the request row's counters
(``delivered_deltas``, ``delivered_output_tokens``, ``last_event_at``) and its
stream guard (``last_seq``), yet 0001's trigger ran its general UPDATE for them:
about 25 filtered aggregates per request, ~75 µs of a single durable append. A
batch of deliveries alone now takes a narrow UPDATE of those four columns (~40 µs);
any other batch takes the general one, unchanged. Same rows either way: the read
models are still checked against ``statemachine.state.fold`` (docs/audit.md).

The general UPDATE also appends the batch's replicas to ``replicas_tried``, which 0001
did in a second UPDATE of the same row for every batch holding an ``AttemptStarted``.

Downgrade puts 0001's function back.
"""

from __future__ import annotations

from alembic import context, op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None

PROJECT_EVENTS = """
CREATE OR REPLACE FUNCTION project_request_events() RETURNS trigger LANGUAGE plpgsql AS $fn$
DECLARE
    has_accepted boolean;
    has_started boolean;
    has_attempt_news boolean;
    has_completed boolean;
    deliveries_only boolean;
    streams integer;
    updated integer;
    culprit record;
BEGIN
    -- one pass to learn which of the steps below this batch needs
    SELECT bool_or(type = 'RequestAccepted'),
           bool_or(type = 'AttemptStarted'),
           bool_or(type IN ('FirstTokenReceived', 'UpstreamFailed', 'AttemptFenced', 'CancelSent',
                            'CancelAcked', 'LeaseExpired', 'AttemptReleased')),
           bool_or(type = 'RequestCompleted'),
           bool_and(type = 'DeltasDelivered'),
           count(DISTINCT request_id)
      INTO has_accepted, has_started, has_attempt_news, has_completed, deliveries_only, streams
      FROM new_events;

    IF has_accepted THEN
        INSERT INTO requests (request_id, tenant, model, model_revision, endpoint, stream,
                              prompt_tokens, n, guided, tools, max_attempts, idempotency_key, seed,
                              gateway, phase, accepted_at, last_event_at, last_seq)
        SELECT request_id, body->>'tenant', body->>'model', body->>'model_revision',
               body->>'endpoint', (body->>'stream')::boolean, (body->>'prompt_tokens')::integer,
               (body->>'n')::integer, (body->>'guided')::boolean, (body->>'tools')::boolean,
               (body->>'max_attempts')::integer, body->>'idempotency_key', (body->>'seed')::bigint,
               body->>'gateway', 'new', occurred_at, occurred_at, 0
          FROM new_events WHERE type = 'RequestAccepted';
    END IF;

    -- The request row, and the stream guard: each request's events in this batch must
    -- start right after its last version. Under READ COMMITTED a concurrent writer's
    -- committed update is re-read before the WHERE is checked, so two writers that
    -- skip past each other are caught too.
    IF deliveries_only THEN
        -- Token deliveries, most of the log, move only the counters: a narrow UPDATE.
        UPDATE requests r SET
            delivered_deltas = greatest(r.delivered_deltas, c.delivered_deltas),
            delivered_output_tokens = r.delivered_output_tokens + c.delivered_tokens,
            last_event_at = greatest(r.last_event_at, c.last_event_at),
            last_seq = c.last_version
          FROM (SELECT request_id,
                       min(version) AS first_version,
                       max(version) AS last_version,
                       count(*) AS events,
                       max(occurred_at) AS last_event_at,
                       max((body->>'to_index')::integer) AS delivered_deltas,
                       sum((body->>'tokens')::integer) AS delivered_tokens
                  FROM new_events
                 GROUP BY request_id) c
         WHERE r.request_id = c.request_id
           AND r.last_seq = c.first_version - 1
           AND c.last_version - c.first_version + 1 = c.events;
    ELSE
        -- The phase is the one set by the batch's last phase-changing event, unless an
        -- AttemptReleased came after a fence (fenced -> prefill). "Last" is found without
        -- a sort: max(version * 8 + phase code) carries both the version and the phase.
        WITH batch AS (
            SELECT request_id,
                   min(version) AS first_version,
                   max(version) AS last_version,
                   count(*) AS events,
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
             GROUP BY request_id
        ), changes AS (
            SELECT batch.*,
                   (ARRAY['prefill', 'decode', 'fenced', 'terminated'])[phase_change % 8] AS set_phase,
                   coalesce(phase_change / 8, 0) AS set_phase_version
              FROM batch
        )
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
          FROM changes c
         WHERE r.request_id = c.request_id
           AND r.last_seq = c.first_version - 1
           AND c.last_version - c.first_version + 1 = c.events;
    END IF;
    GET DIAGNOSTICS updated = ROW_COUNT;
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
               (request_id, attempt, lease_epoch, replica_id, started_at, lease_expires_at)
        SELECT request_id, attempt, lease_epoch, body->>'replica_id', occurred_at,
               (body->>'lease_expires_at')::timestamptz
          FROM new_events WHERE type = 'AttemptStarted';
    END IF;

    IF has_attempt_news THEN
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
          FROM (
            SELECT request_id, attempt,
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
             GROUP BY request_id, attempt
          ) u
         WHERE a.request_id = u.request_id AND a.attempt = u.attempt;
    END IF;

    IF has_completed THEN
        -- the running attempt completed the request (fold: the current attempt)
        UPDATE request_attempts a SET completed_at = e.occurred_at
          FROM new_events e JOIN requests r USING (request_id)
         WHERE e.type = 'RequestCompleted' AND a.request_id = e.request_id AND a.attempt = r.attempts;
    END IF;
    RETURN NULL;
END
$fn$;
"""


def upgrade() -> None:
    op.execute(PROJECT_EVENTS)


def downgrade() -> None:
    previous = context.script.get_revision("0001")
    assert previous is not None and previous.module is not None
    op.execute(previous.module.PROJECT_EVENTS)
