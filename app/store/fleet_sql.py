"""The fleet's statements on PostgreSQL (docs/design.md §16), as :class:`~app.store.fleet.FleetStore`
runs them: an event appended (written, or copied from the replica's row), the membership and
its events read, a lease renewed and lapsed, the live attempts counted per replica."""

from __future__ import annotations

INSERT = """
    INSERT INTO fleet_events (event, replica_id, incarnation, replica_kind, url, models, source, actor, reason,
                              drain_until, instance_id)
    VALUES (:event, :replica_id, :incarnation, :kind, :url, CAST(:models AS jsonb), :source, :actor, :reason,
            NULL, :instance_id)
    RETURNING seq
"""
# cordoned, uncordoned, left: what the replica declared is copied from its row, locked
CHANGE = """
    INSERT INTO fleet_events (event, replica_id, incarnation, replica_kind, url, models, source, actor, reason,
                              drain_until, instance_id)
    SELECT :event, replica_id, incarnation, replica_kind, url, models, :source, :actor, :reason,
           now() + CAST(:drain_ms AS integer) * interval '1 millisecond', :instance_id
      FROM replicas WHERE replica_id = :replica_id AND state = ANY(CAST(:states AS text[]))
    RETURNING seq
"""
MEMBERS = """
    SELECT replica_id, incarnation, replica_kind, url, models, state, source, since, last_seq, drain_until,
           leaving, lease_expires_at, extract(epoch FROM drain_until - now())::float8 AS drain_left_s
      FROM replicas {where} ORDER BY replica_id
"""
RENEW = """
    UPDATE replicas SET lease_ttl_ms = CAST(:ttl_ms AS integer),
           lease_expires_at = now() + CAST(:ttl_ms AS integer) * interval '1 millisecond'
     WHERE replica_id = :replica_id AND incarnation = :incarnation AND state IN ('serving', 'cordoned')
    RETURNING state
"""
LAPSE = """
    WITH lapsed AS (
        SELECT replica_id FROM replicas
         WHERE state IN ('serving', 'cordoned') AND lease_expires_at <= now()
         ORDER BY lease_expires_at LIMIT :limit
           FOR UPDATE SKIP LOCKED)
    INSERT INTO fleet_events (event, replica_id, incarnation, replica_kind, url, models, source, actor, reason,
                              instance_id)
    SELECT 'lapsed', r.replica_id, r.incarnation, r.replica_kind, r.url, r.models, r.source, :actor,
           'its lease was not renewed', :instance_id
      FROM replicas AS r JOIN lapsed USING (replica_id)
    RETURNING replica_id
"""
# attempts of unfinished requests that have not ended, by replica (the log's read models)
LIVE_ATTEMPTS = """
    SELECT a.replica_id, count(*) AS live
      FROM requests AS r JOIN request_attempts AS a USING (request_id)
     WHERE r.outcome IS NULL AND a.completed_at IS NULL AND a.released_at IS NULL AND a.failed_at IS NULL
       AND a.lease_expired_at IS NULL AND a.cancel_acked_at IS NULL
     GROUP BY a.replica_id
"""
EVENTS = """
    SELECT seq, event, replica_id, incarnation, replica_kind, url, models, source, actor, reason, drain_until,
           instance_id, at
      FROM fleet_events {where} ORDER BY seq DESC LIMIT :limit
"""
