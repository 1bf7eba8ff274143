"""DNS discovery writes the fleet (docs/design.md §16), against a real DNS server (dnsmasq,
as tests/app/replicas/test_discovery.py runs it), real workers and real PostgreSQL:

- an address removed under a live stream: the stream completes normally, its transcript
  equal to its log; the replica is cordoned (source ``dns``, with the entry's ``drain_s``)
  and leaves once its attempt ended; no new attempt goes there;
- the DNS server stopped: the fleet stays as it was (no fleet event), the failures are
  counted, requests are served.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import asyncpg

from app.store.database import asyncpg_dsn
from ops.transcript import Transcript
from statemachine import events as ev
from tests.faults.test_instances import read_logs
from tests.support.gateway import MODEL, running_gateway
from tests.support.transcript import check_request
from tests.support.workers import running_worker

from .test_discovery import DOMAIN, NAME, dnsmasq, metric

OTHER = f"other.{DOMAIN}"


def fleet_events(database_url: str) -> list[dict[str, Any]]:
    async def fetch() -> list[dict[str, Any]]:
        connection = await asyncpg.connect(asyncpg_dsn(database_url))
        try:
            rows = await connection.fetch(
                "SELECT event, replica_id, source, reason, drain_until IS NOT NULL AS drain FROM fleet_events"
                " ORDER BY seq"
            )
            return [dict(row) for row in rows]
        finally:
            await connection.close()

    return asyncio.run(fetch())


def attempts_on(database_url: str, request_ids: list[str]) -> dict[str, list[str]]:
    """Each request's attempts' replicas, from its log."""
    logs = read_logs(database_url, request_ids)
    return {rid: [e.replica_id for e in events if isinstance(e, ev.AttemptStarted)] for rid, events in logs.items()}


def until(condition: Any, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_an_address_removed_under_a_live_stream_is_cordoned_then_leaves_and_the_stream_completes(
    database_url: str, tmp_path: Path
) -> None:
    slow = ["--model", MODEL, "--sim-decode-ms-per-token", "40"]
    with (
        running_worker(args=slow) as first,
        running_worker(args=slow) as second,
        dnsmasq(tmp_path, f"127.0.0.1 {NAME}") as server,
    ):
        discover = [
            {"name": NAME, "port": first.port, "nameserver": server.nameserver, "every_s": 0.2, "drain_s": 30},
            {"name": OTHER, "port": second.port, "nameserver": server.nameserver, "every_s": 0.2},
        ]
        gone, kept = f"127.0.0.1:{first.port}@{NAME}", f"127.0.0.1:{second.port}@{OTHER}"
        with running_gateway(database_url, [], discover=discover) as gateway:
            pool = gateway.gateway.ctx.pool
            until(lambda: gone in pool.replicas and pool.replicas[gone].healthy, "the first name's replica")
            client = gateway.openai()
            transcript = Transcript("", 0)
            read: list[str] = []

            def stream() -> None:
                with client.chat.completions.with_streaming_response.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "count"}],
                    max_tokens=80,
                    stream=True,
                    extra_body={"ignore_eos": True},
                ) as response:
                    transcript.request_id = response.headers.get("x-request-id", "")
                    transcript.status = response.status_code
                    for line in response.iter_lines():
                        transcript.read(line)
                        read.append(line)

            reader = threading.Thread(target=stream, daemon=True)
            reader.start()
            until(lambda: len(transcript.contents) >= 3, "the stream to deliver")
            # the first name's address goes; the other name's comes
            server.records(f"127.0.0.1 {OTHER}")
            until(lambda: kept in pool.replicas and pool.replicas[kept].healthy, "the other name's replica")
            until(lambda: gone in pool.replicas and pool.replicas[gone].cordoned, "the cordon to reach the pool")
            assert reader.is_alive(), "the stream was still live when its replica was cordoned"
            placed = []
            for _ in range(4):  # new requests meanwhile: none goes to the cordoned replica
                answer = client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
                placed.append(answer.headers["x-request-id"])
            reader.join(30)
            assert transcript.done and transcript.error is None and len(transcript.contents) == 80
            until(lambda: gone not in pool.replicas, "the replica to leave once its attempt ended")
            logs = read_logs(database_url, [transcript.request_id])
            check_request(logs[transcript.request_id], transcript)
            assert attempts_on(database_url, [transcript.request_id]) == {transcript.request_id: [gone]}
            assert {replica for tried in attempts_on(database_url, placed).values() for replica in tried} == {kept}
            events = fleet_events(database_url)
            mine = [(e["event"], e["source"], e["drain"]) for e in events if e["replica_id"] == gone]
            assert mine == [("joined", "dns", False), ("cordoned", "dns", True), ("left", "dns", False)]
            (cordon,) = [e for e in events if e["replica_id"] == gone and e["event"] == "cordoned"]
            assert cordon["reason"] == f"no longer in the dns {NAME}"
            # the other name's replica was never touched by the first name's set
            assert [e["event"] for e in events if e["replica_id"] == kept] == ["joined"]


def test_a_dns_outage_keeps_the_fleet_as_it_was(database_url: str, tmp_path: Path) -> None:
    with (
        running_worker(args=["--model", MODEL]) as worker,
        dnsmasq(tmp_path, f"127.0.0.1 {NAME}") as server,
    ):
        discover = [{"name": NAME, "port": worker.port, "nameserver": server.nameserver, "every_s": 0.2}]
        with running_gateway(database_url, [], discover=discover) as gateway:
            replica_id = f"127.0.0.1:{worker.port}@{NAME}"
            until(lambda: [e["event"] for e in fleet_events(database_url)] == ["joined"], "the replica to join")
            server.stop()
            failures = f'phasegate_discovery_failures_total{{name="{NAME}"}}'
            until(lambda: metric(gateway.url, failures) >= 3, "failed resolutions to be counted")
            time.sleep(1.0)  # a fleet keeper tick or four: nothing to write
            assert [(e["event"], e["replica_id"]) for e in fleet_events(database_url)] == [("joined", replica_id)]
            assert list(gateway.gateway.ctx.pool.replicas) == [replica_id]
            answer = gateway.openai().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert answer.choices[0].message.content


def test_two_gateways_one_resolves_and_each_change_is_written_once(database_url: str, tmp_path: Path) -> None:
    with (
        running_worker(args=["--model", MODEL]) as worker,
        dnsmasq(tmp_path, f"127.0.0.1 {NAME}") as server,
    ):
        discover = [{"name": NAME, "port": worker.port, "nameserver": server.nameserver, "every_s": 0.2}]
        replica_id = f"127.0.0.1:{worker.port}@{NAME}"
        with (
            running_gateway(database_url, [], discover=discover) as a,
            running_gateway(database_url, [], discover=discover) as b,
        ):
            gateways = (a.gateway, b.gateway)
            until(lambda: all(replica_id in g.ctx.pool.replicas for g in gateways), "both pools to hold it")
            (leader,) = [g for g in gateways if g.fleet.listener.leading]
            (other,) = [g for g in gateways if g is not leader]
            time.sleep(0.5)  # a few turns of each loop
            assert leader.discovery.running[NAME][0].resolutions > 0
            assert other.discovery.running[NAME][0].resolutions == 0  # it does not hold the lock
            server.records()  # the address goes
            until(lambda: all(replica_id not in g.ctx.pool.replicas for g in gateways), "both pools to drop it")
            events = [(e["event"], e["replica_id"], e["source"]) for e in fleet_events(database_url)]
            assert events == [
                ("joined", replica_id, "dns"),
                ("cordoned", replica_id, "dns"),
                ("left", replica_id, "dns"),
            ]
