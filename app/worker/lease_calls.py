"""The lease calls' bodies: renew (one lease, or many in one call) and cancel.

A renewal the gateway sends names its number for the attempt (``renewal``: 1, 2, …) and the
last of them whose answer it got (``answered``; 0: the start's), so that the worker can
keep a renewal whose answer was lost from carrying the lease past the gateway's view of
it (:meth:`app.worker.attempt.Attempt.renewed_until`, docs/worker-protocol.md). A renewal
naming neither (curl, by hand) extends the lease from when it is read, as asked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from app.worker.protocol import Refusal, invalid, no_unknown, required, text, whole


@dataclass(frozen=True, slots=True)
class AttemptRef:
    """Names one attempt's lease: the body of renew and cancel."""

    request_id: str
    attempt: int
    lease_epoch: int
    lease_ttl_s: float | None  # renew only
    renewal: int | None = None  # renew only: this renewal's number, 1, 2, … (None: by hand)
    answered: int | None = None  # with it: the last renewal the gateway got an answer to (0: the start)


_REF = frozenset({"request_id", "attempt", "lease_epoch"})
_RENEW = _REF | {"lease_ttl_ms", "renewal", "answered"}


def parse_ref(body: Mapping[str, Any], *, with_ttl: bool) -> AttemptRef:
    """The body of renew (``with_ttl``) or cancel."""
    no_unknown(body, _RENEW if with_ttl else _REF, "")
    ttl = renewal = answered = None
    if with_ttl:
        ttl = whole(required(body, "lease_ttl_ms"), "lease_ttl_ms", 50, 600_000) / 1000
        if body.get("renewal") is not None or body.get("answered") is not None:
            renewal = whole(required(body, "renewal"), "renewal", 1, 2**62)
            answered = whole(required(body, "answered"), "answered", 0, renewal - 1)
    return AttemptRef(
        request_id=text(required(body, "request_id"), "request_id"),
        attempt=whole(required(body, "attempt"), "attempt", 1, 1_000_000),
        lease_epoch=whole(required(body, "lease_epoch"), "lease_epoch", 0, 2**62),
        lease_ttl_s=ttl,
        renewal=renewal,
        answered=answered,
    )


MAX_RENEWALS = 10_000


def parse_renewals(body: Mapping[str, Any]) -> list[AttemptRef]:
    """The body of a batched renew: ``{"leases": [renew body, …]}``, 1 to 10,000 of them."""
    no_unknown(body, {"leases"}, "")
    leases = required(body, "leases")
    if not isinstance(leases, list) or not 1 <= len(leases) <= MAX_RENEWALS:
        raise invalid("leases", f"must be a list of 1 to {MAX_RENEWALS:,} leases")
    refs = []
    for i, lease in enumerate(leases):
        where = f"leases[{i}]"
        if not isinstance(lease, dict):
            raise invalid(where, "must be an object")
        try:
            refs.append(parse_ref(lease, with_ttl=True))
        except Refusal as refusal:
            field = f"{where}.{refusal.field}" if refusal.field else where
            raise Refusal(refusal.status, refusal.code, f"{where}: {refusal.message}", field=field) from None
    return refs
