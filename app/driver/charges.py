"""Which of a request's failures count toward ejecting a replica, and when.

How this works: most failures are the replica's, and go to the pool at once. A server
error about the request itself (HTTP 500, an engine that failed on it:
:func:`statemachine.request_state.is_server_error`) may be the request's doing: if
another one follows before any output, the policy ends the request as poison
(``poison_request``) and none of them may count, or a few poison requests would eject
every replica (docs/design.md §13). So such a failure is held here until the request shows
which it was: poison (forgiven), or anything else, an attempt that produced a token,
another kind of failure, the end of the request (counted then).
"""

from __future__ import annotations

import logging

from app.replicas.base import UpstreamFailure
from app.replicas.pool import ReplicaPool
from app.replicas.replica import Replica
from statemachine.request_state import is_server_error

log = logging.getLogger("phasegate.driver")


class FailureCharges:
    """One request's failures on their way to the pool's ejection counts."""

    __slots__ = ("_held", "_pool", "_request_id")

    def __init__(self, pool: ReplicaPool, request_id: str) -> None:
        self._pool = pool
        self._request_id = request_id
        self._held: list[tuple[Replica, UpstreamFailure]] = []

    def observe(self, replica: Replica, failure: UpstreamFailure) -> None:
        """An attempt on ``replica`` failed: account it now, or hold a server error."""
        if is_server_error(failure.status, failure.code):
            self._held.append((replica, failure))
        else:
            self._pool.observe(replica, failure)

    def settle(self, *, poison: bool) -> None:
        """The request showed what its held server errors were: count them, or forgive them."""
        held, self._held = self._held, []
        if poison and held:
            replicas = ", ".join(replica.id for replica, _ in held)
            log.info("request %s is poison: its server errors on %s eject nothing", self._request_id, replicas)
            return
        for replica, failure in held:
            self._pool.observe(replica, failure)
