"""The read models of a bulk load, built set-based: what the projection trigger writes.

How this works: the trigger ``project_request_events`` (migrations/, 0002, 0007) inserts a
request's row on ``RequestAccepted`` and then UPDATEs it, and its attempts' rows, with
aggregates over each batch. A bulk load brings whole, new requests, so their read
models are those aggregates over the request's whole stream taken as one batch (the
trigger over one batch and over one event at a time write the same rows: the
trigger's own tests and ``tests/app/store/test_bulk.py`` hold that). Here each row is
written once, by an ``INSERT ... SELECT`` of those aggregates over ``new_events`` (a
temporary view of the loaded rows): no row is updated, nothing is inserted twice. The
tables written are placeholders, ``{requests}`` and ``{request_attempts}`` (:func:`into`):
the parents, or one day's tables before they are attached (:mod:`app.store.bulk`).

The expressions are the trigger's, with the row's starting values (``attempts = 0``,
``replicas_tried = '{}'``, ...) folded in, and each row's partition key ``accepted_on``
(migration 0007) taken from its request's events, as the trigger takes it. A migration that changes the projection must
change them too: ``tests/app/store/test_bulk.py`` compares the two builds row for row.

The stream guard is the trigger's too: each request's versions must run 1, 2, ... with
one ``RequestAccepted``, or the load fails with ``PG409`` (``refuse``, called only for a
broken stream). Duplicate versions are caught by the stream's unique constraint, in
place or built at the end of the load.
"""

from __future__ import annotations


def into(statement: str, *, requests: str = "requests", request_attempts: str = "request_attempts") -> str:
    """``statement`` (:data:`PROJECT_REQUESTS`, :data:`PROJECT_ATTEMPTS`) writing the
    tables named (ours, never a user's text: they are spliced into the SQL)."""
    return statement.replace("{requests}", requests).replace("{request_attempts}", request_attempts)


# Raises the error the trigger would have raised; returns only to sit in a WHERE.
REFUSE = """
CREATE FUNCTION pg_temp.refuse(message text, sqlstate text) RETURNS boolean LANGUAGE plpgsql AS $fn$
BEGIN
    RAISE EXCEPTION USING MESSAGE = message, ERRCODE = sqlstate;
END
$fn$
"""

PROJECT_REQUESTS = """
WITH stream AS (
    SELECT request_id, accepted_on,
           min(version) AS first_version,
           max(version) AS last_version,
           count(*) AS events,
           count(*) FILTER (WHERE type = 'RequestAccepted') AS accepted_events,
           (array_agg(accepted) FILTER (WHERE type = 'RequestAccepted'))[1] AS accepted,
           min(occurred_at) FILTER (WHERE type = 'RequestAccepted') AS accepted_at,
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
           array_agg(replica_id ORDER BY version) FILTER (WHERE type = 'AttemptStarted') AS replicas_started,
           min(attempt) FILTER (WHERE type = 'FirstDeltaCommitted') AS first_delta_attempt,
           min(occurred_at) FILTER (WHERE type = 'FirstDeltaCommitted') AS first_delta_at,
           max(to_index::integer) FILTER (WHERE type = 'DeltasDelivered') AS delivered_deltas,
           sum(tokens::integer) FILTER (WHERE type = 'DeltasDelivered') AS delivered_tokens,
           max(tokens::integer) FILTER (WHERE type = 'StreamResumed') AS read_tokens,
           max(to_index::integer) FILTER (WHERE type = 'StreamResumed') AS read_deltas,
           count(*) FILTER (WHERE type = 'ToolCallEmitted') AS tool_calls,
           count(*) FILTER (WHERE type = 'Decided') AS decisions,
           min(occurred_at) FILTER (WHERE type = 'ClientDisconnected') AS client_disconnected_at,
           -- at most one terminal event per request, so min() just picks it
           min(CASE type WHEN 'RequestCompleted' THEN 'completed' WHEN 'RequestFailed' THEN 'failed'
                         WHEN 'RequestCancelled' THEN 'cancelled' END) AS outcome,
           min(code_or_reason) FILTER (WHERE type IN ('RequestFailed', 'RequestCancelled')) AS error_code,
           min(message) FILTER (WHERE type = 'RequestFailed') AS error_message,
           bool_or(retryable::boolean) FILTER (WHERE type = 'RequestFailed') AS retryable,
           min(finish_reason) FILTER (WHERE type = 'RequestCompleted') AS finish_reason,
           min(usage) FILTER (WHERE type = 'RequestCompleted') AS usage,
           min(occurred_at) FILTER (WHERE type IN ('RequestCompleted', 'RequestFailed',
                                                   'RequestCancelled')) AS finished_at
      -- each event's fields read out of its body before the sort by request, which then
      -- sorts narrow rows, not every delivery's text (OFFSET 0 keeps it a subquery)
      FROM (SELECT request_id, accepted_on, version, type, attempt, occurred_at,
                   CASE WHEN type = 'RequestAccepted' THEN body END AS accepted,
                   CASE WHEN type = 'AttemptStarted' THEN body->>'replica_id' END AS replica_id,
                   CASE WHEN type IN ('DeltasDelivered', 'StreamResumed') THEN body->>'to_index' END AS to_index,
                   CASE WHEN type IN ('DeltasDelivered', 'StreamResumed') THEN body->>'tokens' END AS tokens,
                   CASE WHEN type IN ('RequestFailed', 'RequestCancelled')
                        THEN coalesce(body->>'code', body->>'reason') END AS code_or_reason,
                   CASE WHEN type = 'RequestFailed' THEN body->>'message' END AS message,
                   CASE WHEN type = 'RequestFailed' THEN body->>'retryable' END AS retryable,
                   CASE WHEN type = 'RequestCompleted' THEN body->>'finish_reason' END AS finish_reason,
                   CASE WHEN type = 'RequestCompleted' THEN (body->'usage')::text END AS usage
              FROM new_events
            OFFSET 0) e
     GROUP BY request_id, accepted_on
), phased AS NOT MATERIALIZED (
    SELECT stream.*,
           coalesce((ARRAY['prefill', 'decode', 'fenced', 'terminated'])[phase_change % 8], 'new') AS last_phase,
           coalesce(phase_change / 8, 0) AS last_phase_version
      FROM stream
     WHERE CASE WHEN first_version = 1 AND last_version = events AND accepted_events = 1 THEN true
                ELSE pg_temp.refuse(format('request %s : version %s does not follow the stream''s last version 0',
                                           request_id, first_version), 'PG409') END
)
INSERT INTO {requests} (request_id, tenant, model, model_revision, endpoint, stream, prompt_tokens, n,
                      guided, tools, max_attempts, idempotency_key, seed, gateway, phase, outcome,
                      error_code, error_message, retryable, finish_reason, usage, attempts,
                      replicas_tried, first_delta_attempt, delivered_deltas, delivered_output_tokens,
                      tool_calls, decisions, accepted_at, first_delta_at, client_disconnected_at,
                      finished_at, last_event_at, last_seq, ttft_ms, duration_ms, decode_ms, accepted_on)
SELECT request_id, accepted->>'tenant', accepted->>'model', accepted->>'model_revision',
       accepted->>'endpoint', (accepted->>'stream')::boolean, (accepted->>'prompt_tokens')::integer,
       (accepted->>'n')::integer, (accepted->>'guided')::boolean, (accepted->>'tools')::boolean,
       (accepted->>'max_attempts')::integer, accepted->>'idempotency_key', (accepted->>'seed')::bigint,
       accepted->>'gateway',
       -- an AttemptReleased after the last fence moves the request back to prefill
       CASE WHEN last_phase = 'fenced' AND released_version > last_phase_version
            THEN 'prefill' ELSE last_phase END,
       outcome, error_code, error_message, retryable, finish_reason, usage::jsonb,
       coalesce(attempts, 0), coalesce(replicas_started, '{}'), first_delta_attempt,
       greatest(0, delivered_deltas, read_deltas), greatest(coalesce(delivered_tokens, 0), read_tokens), tool_calls,
       decisions,
       accepted_at, first_delta_at, client_disconnected_at, finished_at,
       greatest(accepted_at, last_event_at), last_version,
       milliseconds(first_delta_at - accepted_at), milliseconds(finished_at - accepted_at),
       milliseconds(finished_at - first_delta_at), accepted_on
  FROM phased
"""

# Runs after PROJECT_REQUESTS, whose rows say which attempt completed the request: the
# last one started (fold's current attempt), at the request's terminal event.
PROJECT_ATTEMPTS = """
WITH attempt AS (
    SELECT request_id, accepted_on, attempt,
           min(lease_epoch) FILTER (WHERE type = 'AttemptStarted') AS lease_epoch,
           (array_agg(body) FILTER (WHERE type = 'AttemptStarted'))[1] AS started,
           min(occurred_at) FILTER (WHERE type = 'AttemptStarted') AS started_at,
           count(*) FILTER (WHERE type = 'AttemptStarted') AS starts,
           min(occurred_at) FILTER (WHERE type = 'FirstTokenReceived') AS first_token_at,
           -- the last failure, as fold keeps it
           (array_agg(body ORDER BY version DESC) FILTER (WHERE type = 'UpstreamFailed'))[1] AS failure,
           (array_agg(occurred_at ORDER BY version DESC) FILTER (WHERE type = 'UpstreamFailed'))[1]
               AS failed_at,
           min(occurred_at) FILTER (WHERE type = 'AttemptFenced') AS fenced_at,
           min(body->>'waiting_for') FILTER (WHERE type = 'AttemptFenced') AS waiting_for,
           min(occurred_at) FILTER (WHERE type = 'CancelSent') AS cancel_sent_at,
           min(occurred_at) FILTER (WHERE type = 'CancelAcked') AS cancel_acked_at,
           min((body->>'generated_tokens')::integer) FILTER (WHERE type = 'CancelAcked') AS generated_tokens,
           min(occurred_at) FILTER (WHERE type = 'LeaseExpired') AS lease_expired_at,
           min(occurred_at) FILTER (WHERE type = 'AttemptReleased') AS released_at,
           min(body->>'because') FILTER (WHERE type = 'AttemptReleased') AS released_because
      FROM new_events
     WHERE type IN ('AttemptStarted', 'FirstTokenReceived', 'UpstreamFailed', 'AttemptFenced', 'CancelSent',
                    'CancelAcked', 'LeaseExpired', 'AttemptReleased')
     GROUP BY request_id, accepted_on, attempt
)
INSERT INTO {request_attempts} (request_id, attempt, lease_epoch, replica_id, started_at, lease_expires_at,
                              first_token_at, failure_kind, failure_detail, failure_deadline,
                              upstream_status, upstream_code, failed_at, fenced_at, waiting_for,
                              cancel_sent_at, cancel_acked_at, generated_tokens, lease_expired_at,
                              released_at, released_because, completed_at, fence_ms, accepted_on)
SELECT a.request_id, a.attempt, a.lease_epoch, a.started->>'replica_id', a.started_at,
       (a.started->>'lease_expires_at')::timestamptz,
       a.first_token_at, a.failure->>'kind', a.failure->>'detail', a.failure->>'deadline',
       (a.failure->>'upstream_status')::integer, a.failure->>'upstream_code', a.failed_at, a.fenced_at,
       a.waiting_for, a.cancel_sent_at, a.cancel_acked_at, a.generated_tokens, a.lease_expired_at,
       a.released_at, a.released_because,
       CASE WHEN r.outcome = 'completed' AND r.attempts = a.attempt THEN r.finished_at END,
       milliseconds(a.released_at - a.fenced_at), a.accepted_on
  FROM attempt a JOIN {requests} r USING (request_id, accepted_on)
 -- an attempt's news without its AttemptStarted make no row (the trigger's UPDATE finds
 -- none); two starts of one attempt fail as the trigger's INSERT does, on the primary key
 WHERE CASE WHEN a.starts <= 1 THEN a.starts = 1
            ELSE pg_temp.refuse(format('duplicate key value violates unique constraint "request_attempts_pkey": '
                                       'attempt %s of request %s started twice', a.attempt, a.request_id),
                                '23505') END
"""
