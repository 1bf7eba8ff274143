"""How a worker joins the fleet by itself (docs/worker-protocol.md, "Joining the fleet").

The gateway's side of the worker protocol: a worker started with ``--join URL`` posts
to these routes of any gateway instance, with the worker token as its bearer token, and
renews its lease every ``RENEW_EVERY_S``; one that stops renewing for ``LEASE_TTL_S`` is
marked ``lapsed`` by a live instance (docs/design.md §16).

    POST /fleet/join    {"id", "incarnation", "url", "models": {NAME: REVISION or null}}
    POST /fleet/renew   {"id", "incarnation"}    404 replica_not_member: join again
    POST /fleet/cordon  {"id", "incarnation"}    a draining worker cordons itself first
    POST /fleet/leave   {"id", "incarnation"}    and leaves at its exit
"""

from __future__ import annotations

JOIN_PATH = "/fleet/join"
RENEW_PATH = "/fleet/renew"
CORDON_PATH = "/fleet/cordon"
LEAVE_PATH = "/fleet/leave"
LEASE_TTL_S = 10.0  # a joined worker's lease, on PostgreSQL's clock
RENEW_EVERY_S = LEASE_TTL_S / 4  # a renewal lost or late still leaves the lease standing
NOT_MEMBER = "replica_not_member"  # a renewal's answer when the lease is gone: join again
