"""The log's tables as SQLAlchemy Core sees them, for the queries in this package.

The DDL itself lives in ``migrations/`` (it has a trigger and columns Core does not
model); these definitions name only the columns the store reads or writes.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, DateTime, Integer, MetaData, SmallInteger, Table, Text, Uuid
from sqlalchemy.dialects.postgresql import ARRAY, JSON, JSONB

metadata = MetaData()

request_events = Table(
    "request_events",
    metadata,
    Column("position", BigInteger, primary_key=True),
    Column("request_id", Text, nullable=False),
    Column("version", Integer, nullable=False),
    Column("event_id", Uuid, nullable=False),
    Column("type", Text, nullable=False),
    Column("schema_version", SmallInteger, nullable=False),
    Column("attempt", Integer),
    Column("lease_epoch", Integer),
    Column("occurred_at", DateTime(timezone=True), nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False),
    Column("body", JSONB, nullable=False),
)

requests = Table(
    "requests",
    metadata,
    Column("request_id", Text, primary_key=True),
    Column("tenant", Text),
    Column("gateway", Text),
    Column("accepted_at", DateTime(timezone=True)),
    Column("model", Text),
    Column("phase", Text),
    Column("outcome", Text),
    Column("error_code", Text),
    Column("finish_reason", Text),
    Column("attempts", Integer),
    Column("replicas_tried", ARRAY(Text)),
    Column("first_delta_attempt", Integer),
    Column("delivered_deltas", Integer),
    Column("delivered_output_tokens", Integer),
    Column("tool_calls", Integer),
    Column("client_disconnected_at", DateTime(timezone=True)),
    Column("last_seq", Integer),
)

request_attempts = Table(
    "request_attempts",
    metadata,
    Column("request_id", Text, primary_key=True),
    Column("attempt", Integer, primary_key=True),
    Column("lease_epoch", Integer),
    Column("replica_id", Text),
    Column("first_token_at", DateTime(timezone=True)),
    Column("failure_kind", Text),
    Column("fenced_at", DateTime(timezone=True)),
    Column("cancel_sent_at", DateTime(timezone=True)),
    Column("cancel_acked_at", DateTime(timezone=True)),
    Column("lease_expired_at", DateTime(timezone=True)),
    Column("released_because", Text),
    Column("ended", Text),
)

tool_executions = Table(
    "tool_executions",
    metadata,
    Column("idempotency_key", Text, primary_key=True),
    Column("request_id", Text, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("tool_call_id", Text, nullable=False),
    Column("name", Text, nullable=False),
    Column("arguments", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("result", JSONB(none_as_null=True)),
    Column("error", Text),
    Column("claimed_at", DateTime(timezone=True), nullable=False),
    Column("finished_at", DateTime(timezone=True)),
)

request_inputs = Table(
    "request_inputs",
    metadata,
    Column("request_id", Text, primary_key=True),
    Column("body", JSON, nullable=False),  # json, not jsonb: it holds U+0000 too (migration 0003)
    Column("model_revision", Text),
    Column("seed", BigInteger),
)
