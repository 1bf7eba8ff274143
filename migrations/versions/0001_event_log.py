"""The event log, its read models, the tool ledger and recorded inputs.

Revision ID: 0001
Revises:
Create Date: 2026-11-30

``request_events`` is the log (docs/design.md §8). ``requests`` and ``request_attempts``
are its read models: a statement-level trigger projects every INSERT into them in
the same transaction, set-based over the inserted rows, so a batch of a thousand
token deliveries costs one UPDATE per request, not one per event. The trigger also
guards each stream: a batch must continue its request's last version exactly
(``UNIQUE (request_id, version)`` alone would let a writer skip versions); a gap
raises SQLSTATE ``PG409``, which the store reports as ``StreamConflict``.

The projection mirrors ``statemachine.state.fold`` and is checked against it
(docs/audit.md, "fold disagrees with the read model").
"""

from __future__ import annotations

from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

TABLES = """
CREATE TABLE request_events (
    position       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    request_id     text        NOT NULL,
    version        integer     NOT NULL CHECK (version >= 1),
    -- a digest of the event's canonical JSON: a retried append is a no-op
    event_id       uuid        NOT NULL,
    type           text        NOT NULL,
    schema_version smallint    NOT NULL,
    attempt        integer,
    lease_epoch    integer,
    occurred_at    timestamptz NOT NULL,
    recorded_at    timestamptz NOT NULL DEFAULT now(),
    body           jsonb       NOT NULL,
    -- the writing transaction: followers read up to the oldest one still running
    -- (app/store/follow.py), so nothing committed out of position order is missed
    txid           xid8        NOT NULL DEFAULT pg_current_xact_id(),
    CONSTRAINT request_events_event_id_key UNIQUE (event_id),
    CONSTRAINT request_events_stream_key UNIQUE (request_id, version)
);
CREATE INDEX request_events_follow_idx ON request_events (txid, position);

-- fillfactor leaves room for HOT updates: deliveries touch no indexed column
CREATE TABLE requests (
    request_id              text PRIMARY KEY,
    tenant                  text        NOT NULL,
    model                   text        NOT NULL,
    model_revision          text        NOT NULL,
    endpoint                text        NOT NULL,
    stream                  boolean     NOT NULL,
    prompt_tokens           integer     NOT NULL,
    n                       integer     NOT NULL,
    guided                  boolean     NOT NULL,
    tools                   boolean     NOT NULL,
    max_attempts            integer     NOT NULL,
    idempotency_key         text,
    seed                    bigint,
    gateway                 text,       -- the gateway process that owns the request
    phase                   text        NOT NULL,   -- statemachine.phases.Phase
    outcome                 text,                   -- completed | failed | cancelled
    error_code              text,                   -- RequestFailed.code or RequestCancelled.reason
    error_message           text,
    retryable               boolean,
    finish_reason           text,
    usage                   jsonb,
    attempts                integer     NOT NULL DEFAULT 0,
    replicas_tried          text[]      NOT NULL DEFAULT '{}',
    first_delta_attempt     integer,
    first_delta_sent        boolean GENERATED ALWAYS AS (first_delta_attempt IS NOT NULL) STORED,
    delivered_deltas        integer     NOT NULL DEFAULT 0,
    delivered_output_tokens integer     NOT NULL DEFAULT 0,
    tool_calls              integer     NOT NULL DEFAULT 0,
    decisions               integer     NOT NULL DEFAULT 0,
    accepted_at             timestamptz NOT NULL,
    first_delta_at          timestamptz,
    client_disconnected_at  timestamptz,
    finished_at             timestamptz,
    last_event_at           timestamptz NOT NULL,
    last_seq                integer     NOT NULL,
    -- Durations in milliseconds, set by the projection when their end is known (not
    -- generated columns: those are recomputed on every delivery's update).
    ttft_ms                 double precision,  -- accepted to first delivered delta: what the client waited
    duration_ms             double precision,  -- accepted to the terminal event
    decode_ms               double precision   -- first delivered delta to the terminal event
) WITH (fillfactor = 80);
CREATE INDEX requests_accepted_idx ON requests (accepted_at);
CREATE INDEX requests_model_idx ON requests (model, accepted_at);
CREATE INDEX requests_tenant_idx ON requests (tenant, accepted_at);
CREATE INDEX requests_error_idx ON requests (error_code, finished_at) WHERE error_code IS NOT NULL;
-- what a restarted gateway looks for: its requests that never ended
CREATE INDEX requests_unfinished_idx ON requests (gateway, accepted_at) WHERE outcome IS NULL;

CREATE TABLE request_attempts (
    request_id       text        NOT NULL REFERENCES requests ON DELETE CASCADE,
    attempt          integer     NOT NULL,
    lease_epoch      integer     NOT NULL,
    replica_id       text        NOT NULL,
    started_at       timestamptz NOT NULL,
    lease_expires_at timestamptz NOT NULL,
    first_token_at   timestamptz,
    failure_kind     text,       -- the last UpstreamFailed, as in fold
    failure_detail   text,
    failure_deadline text,
    upstream_status  integer,
    upstream_code    text,
    failed_at        timestamptz,
    fenced_at        timestamptz,
    waiting_for      text,
    cancel_sent_at   timestamptz,
    cancel_acked_at  timestamptz,
    generated_tokens integer,    -- as reported with the cancel acknowledgement
    lease_expired_at timestamptz,
    released_at      timestamptz,
    released_because text,
    completed_at     timestamptz,
    -- how it ended, in the words of AttemptState.ended; NULL while presumed live
    ended text GENERATED ALWAYS AS (CASE
        WHEN completed_at IS NOT NULL THEN 'completed'
        WHEN released_because IS NOT NULL THEN released_because
        WHEN failure_kind IN ('replica_exited', 'rejected', 'request_refused') THEN failure_kind
    END) STORED,
    fence_ms         double precision,  -- fenced to released, set on release
    PRIMARY KEY (request_id, attempt)
);
CREATE INDEX request_attempts_replica_idx ON request_attempts (replica_id, started_at);
CREATE INDEX request_attempts_fenced_idx ON request_attempts (fenced_at) WHERE fenced_at IS NOT NULL;

CREATE TABLE tool_executions (
    idempotency_key text PRIMARY KEY,   -- {request_id}:{tool_call_id}
    request_id      text        NOT NULL,
    attempt         integer     NOT NULL,
    tool_call_id    text        NOT NULL,
    name            text        NOT NULL,
    arguments       text        NOT NULL,
    status          text        NOT NULL DEFAULT 'claimed'
                    CHECK (status IN ('claimed', 'succeeded', 'failed')),
    result          jsonb,
    error           text,
    claimed_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz
);
CREATE INDEX tool_executions_request_idx ON tool_executions (request_id);

-- what a request asked for, so an incident can be replayed with its inputs
CREATE TABLE request_inputs (
    request_id     text PRIMARY KEY,
    body           jsonb       NOT NULL,
    model_revision text,
    seed           bigint,
    recorded_at    timestamptz NOT NULL DEFAULT now()
);
"""

MILLISECONDS = """
CREATE FUNCTION milliseconds(elapsed interval) RETURNS double precision
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN extract(epoch FROM elapsed)::double precision * 1000;
"""

# the projection as of this revision (0002 replaces it; its downgrade puts this back)
PROJECT_EVENTS = """
CREATE OR REPLACE FUNCTION project_request_events() RETURNS trigger LANGUAGE plpgsql AS $fn$
DECLARE
    has_accepted boolean;
    has_started boolean;
    has_attempt_news boolean;
    has_completed boolean;
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
           count(DISTINCT request_id)
      INTO has_accepted, has_started, has_attempt_news, has_completed, streams
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
    --
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
        UPDATE requests r SET replicas_tried = r.replicas_tried || s.replicas
          FROM (SELECT request_id, array_agg(body->>'replica_id' ORDER BY version) AS replicas
                  FROM new_events WHERE type = 'AttemptStarted' GROUP BY request_id) s
         WHERE r.request_id = s.request_id;
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

TRIGGER = """
CREATE TRIGGER request_events_project AFTER INSERT ON request_events
REFERENCING NEW TABLE AS new_events
FOR EACH STATEMENT EXECUTE FUNCTION project_request_events();
"""


def _statements(script: str) -> list[str]:
    # SQLAlchemy's asyncpg driver prepares what it runs, so one statement at a time.
    # In the scripts above a statement ends at an unindented line ending in ";"
    # (inside the function body every line is indented, up to "$fn$;").
    statements, current = [], []
    for line in script.strip().splitlines():
        current.append(line)
        if line.endswith(";") and not line.startswith(" "):
            statements.append("\n".join(current))
            current = []
    assert not "".join(current).strip(), "a statement of the migration lacks its final ';'"
    return statements


def upgrade() -> None:
    for statement in _statements(TABLES) + _statements(MILLISECONDS + PROJECT_EVENTS + TRIGGER):
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP TRIGGER request_events_project ON request_events")
    op.execute("DROP FUNCTION project_request_events()")
    op.execute("DROP FUNCTION milliseconds(interval)")
    op.execute("DROP TABLE request_inputs, tool_executions, request_attempts, requests, request_events")
