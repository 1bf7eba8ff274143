"""The reasons events carry (docs/design.md §3): why a choice stopped, what a failed attempt
was observed as, which deadline gave it up, why an attempt is known to have stopped.
Imported through :mod:`statemachine.events`, the log's vocabulary, where they are used."""

from __future__ import annotations

import enum

# Why a choice stopped, as OpenAI and vLLM say it; the fold refuses any other word.
FINISH_REASONS = frozenset(
    {"stop", "length", "tool_calls", "content_filter", "function_call", "abort", "error", "repetition"}
)


class FailureKind(enum.StrEnum):
    """What the driver observed when an attempt failed (docs/design.md §4)."""

    REPLICA_EXITED = "replica_exited"  # process gone, connection refused/reset, worker exiting
    LIVENESS_UNCERTAIN = "liveness_uncertain"  # stall, read timeout, partition, malformed stream
    OVERLOADED = "overloaded"  # heartbeats show queueing or a long prefill
    REJECTED = "rejected"  # refused before starting (queue full, 429, 5xx at start)
    REQUEST_REFUSED = "request_refused"  # upstream 4xx on the request itself: not retryable


class Deadline(enum.StrEnum):
    """Which timer turned a slow attempt into an observed failure."""

    SOFT = "soft"  # a slow replica is not migrated on this one
    HARD = "hard"  # the attempt is given up: fenced, then retried if nothing was delivered


class ReleaseReason(enum.StrEnum):
    """Why an attempt is known to have stopped publishing."""

    CANCEL_ACKED = "cancel_acked"
    LEASE_EXPIRED = "lease_expired"
    REPLICA_EXITED = "replica_exited"
    # the gateway closed the stream of a replica that aborts on a closed connection (an
    # OpenAI-compatible server), fenced before any delivery: assumed, not proven (docs/design.md §7)
    CONNECTION_CLOSED = "connection_closed"
