"""DNS discovery (app/replicas/discovery.py) against a real DNS server: dnsmasq on the
loopback at a free port, answering from a hosts file the test rewrites (SIGHUP makes it
read the file again) and SRV records given on its command line.

- the set follows the records within two resolutions;
- SRV records give each target's addresses with the record's port;
- a gateway with ``[[discover]]`` serves through the replicas the name declares; with the
  DNS server stopped it keeps them, and ``phasegate_discovery_failures_total`` says so.

dnsmasq comes from Debian (.ci/dnsmasq); without it these tests skip, unless
PHASEGATE_REQUIRE_DNSMASQ is set, where they fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import grp
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from app.config import ReplicaConfig
from app.discover_config import DiscoverConfig, parse_discover
from app.replicas.discovery import Address, Discovery
from tests.support.gateway import MODEL, running_gateway
from tests.support.workers import running_worker

DOMAIN = "test.internal"
NAME = f"vllm.{DOMAIN}"


def dnsmasq_binary() -> str:
    found = os.environ.get("PHASEGATE_DNSMASQ") or shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
    if not Path(found).exists():
        why = "dnsmasq is not installed (.ci/dnsmasq installs it)"
        if os.environ.get("PHASEGATE_REQUIRE_DNSMASQ"):
            pytest.fail(why + "; PHASEGATE_REQUIRE_DNSMASQ forbids skipping")
        pytest.skip(why)
    return found


def free_udp_and_tcp_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port = int(udp.getsockname()[1])
            with socket.socket() as tcp, contextlib.suppress(OSError):
                tcp.bind(("127.0.0.1", port))
                return port


@dataclass
class Dnsmasq:
    binary: str
    folder: Path
    port: int
    srv: tuple[str, ...]
    process: subprocess.Popen[bytes] | None = None

    @property
    def hosts(self) -> Path:
        return self.folder / "hosts"

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def records(self, *lines: str) -> None:
        """The hosts file's lines (``ADDRESS NAME``), read again by the running server."""
        self.hosts.write_text("".join(line + "\n" for line in lines))
        if self.process is not None:
            self.process.send_signal(signal.SIGHUP)

    def start(self) -> None:
        user, group = pwd.getpwuid(os.getuid()).pw_name, grp.getgrgid(os.getgid()).gr_name
        command = [self.binary, "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts"]
        command += [f"--addn-hosts={self.hosts}", f"--local=/{DOMAIN}/", "--listen-address=127.0.0.1"]
        command += ["--bind-interfaces", f"--port={self.port}", "--pid-file=", f"--user={user}", f"--group={group}"]
        command += ["--log-facility=-", "--cache-size=0", *(f"--srv-host={record}" for record in self.srv)]
        with (self.folder / "dnsmasq.log").open("ab") as log:  # the server keeps its own copy
            self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 10
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dnsmasq did not start: {(self.folder / 'dnsmasq.log').read_text()}")
            time.sleep(0.05)

    def _answers(self) -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", self.port)) == 0

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        self.process = None


@contextlib.contextmanager
def dnsmasq(tmp_path: Path, *lines: str, srv: tuple[str, ...] = ()) -> Iterator[Dnsmasq]:
    folder = tmp_path / "dns"
    folder.mkdir()
    folder.chmod(0o755)
    server = Dnsmasq(dnsmasq_binary(), folder, free_udp_and_tcp_port(), srv)
    server.records(*lines)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def entry(server: Dnsmasq, **settings: object) -> DiscoverConfig:
    (found,) = parse_discover([{"name": NAME, "port": 8000, "nameserver": server.nameserver, **settings}])
    return found


class Sets:
    """What a :class:`Discovery` handed on, and the failures it reported."""

    def __init__(self) -> None:
        self.sets: list[frozenset[Address]] = []
        self.failures: list[str] = []

    def found(self, entry: DiscoverConfig, addresses: frozenset[Address]) -> None:
        self.sets.append(addresses)

    def failed(self, entry: DiscoverConfig, reason: str) -> None:
        self.failures.append(reason)


async def until(condition: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_the_set_follows_the_records_within_two_resolutions(tmp_path: Path) -> None:
    with dnsmasq(tmp_path, f"127.0.0.11 {NAME}", f"127.0.0.12 {NAME}", f"::1 {NAME}") as server:
        seen = Sets()
        discovery = Discovery(entry(server, every_s=0.2), seen.found, seen.failed)
        running = asyncio.create_task(discovery.run())
        try:
            await until(lambda: seen.sets)
            assert seen.sets == [{("127.0.0.11", 8000), ("127.0.0.12", 8000), ("::1", 8000)}]
            before = discovery.resolutions
            server.records(f"127.0.0.11 {NAME}", f"127.0.0.13 {NAME}")
            await until(lambda: len(seen.sets) == 2)
            assert seen.sets[-1] == {("127.0.0.11", 8000), ("127.0.0.13", 8000)}
            assert discovery.resolutions - before <= 2  # the changed set came with the first or second
            assert seen.failures == []
        finally:
            running.cancel()


async def test_srv_records_give_each_targets_addresses_with_the_records_port(tmp_path: Path) -> None:
    srv = (f"_vllm._tcp.{DOMAIN},a.{DOMAIN},8001", f"_vllm._tcp.{DOMAIN},b.{DOMAIN},8002")
    with dnsmasq(tmp_path, f"127.0.0.21 a.{DOMAIN}", f"127.0.0.22 b.{DOMAIN}", srv=srv) as server:
        seen = Sets()
        (found,) = parse_discover([{"name": f"_vllm._tcp.{DOMAIN}", "srv": True, "nameserver": server.nameserver}])
        await Discovery(found, seen.found, seen.failed).resolve_once()
        assert seen.sets == [{("127.0.0.21", 8001), ("127.0.0.22", 8002)}]


async def test_a_name_with_no_records_declares_no_replica(tmp_path: Path) -> None:
    with dnsmasq(tmp_path, f"127.0.0.11 other.{DOMAIN}") as server:
        seen = Sets()
        await Discovery(entry(server), seen.found, seen.failed).resolve_once()
        assert seen.sets == [frozenset()] and seen.failures == []


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_gateway_serves_through_the_replicas_a_name_declares_and_keeps_them_when_dns_fails(
    database_url: str, tmp_path: Path
) -> None:
    with (
        running_worker(args=["--model", MODEL]) as worker,
        dnsmasq(tmp_path, f"127.0.0.1 {NAME}") as server,
    ):
        discover = [{"name": NAME, "port": worker.port, "nameserver": server.nameserver, "every_s": 0.2}]
        with running_gateway(database_url, [], discover=discover) as gateway:
            replica_id = f"127.0.0.1:{worker.port}@{NAME}"
            deadline = time.monotonic() + 10
            while replica_id not in gateway.gateway.ctx.pool.replicas:
                assert time.monotonic() < deadline, "the discovered replica never joined the pool"
                time.sleep(0.05)
            client = gateway.openai()
            answer = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert answer.choices[0].message.content
            failures = f'phasegate_discovery_failures_total{{name="{NAME}"}}'
            # a healthy name's query may still time out now and then on a loaded machine
            # (every_s bounds each query): count from here
            before = metric(gateway.url, failures)
            server.stop()
            deadline = time.monotonic() + 15
            while metric(gateway.url, failures) < before + 2:
                assert time.monotonic() < deadline, "the failed resolutions were never counted"
                time.sleep(0.1)
            assert metric(gateway.url, f'phasegate_discovery_addresses{{name="{NAME}"}}') == 1
            assert list(gateway.gateway.ctx.pool.replicas) == [replica_id]  # the last known set stays
            again = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert again.choices[0].message.content


def test_a_reload_that_removes_a_name_takes_its_replicas_and_series_with_it(database_url: str, tmp_path: Path) -> None:
    with (
        running_worker(args=["--model", MODEL]) as worker,
        dnsmasq(tmp_path, f"127.0.0.1 {NAME}") as server,
    ):
        discover = [{"name": NAME, "port": worker.port, "nameserver": server.nameserver, "every_s": 0.2}]
        with running_gateway(database_url, [], discover=discover) as gateway:
            pool = gateway.gateway.ctx.pool
            deadline = time.monotonic() + 10
            while not pool.replicas:
                assert time.monotonic() < deadline, "the discovered replica never joined the pool"
                time.sleep(0.05)
            named = ReplicaConfig("w1", worker.base_url)
            reloaded = dataclasses.replace(gateway.config, discover=(), replicas=(named,))
            gateway.loop.call_soon_threadsafe(gateway.gateway.reload, reloaded)
            deadline = time.monotonic() + 10
            while list(pool.replicas) != ["w1"]:
                assert time.monotonic() < deadline, f"the pool is {list(pool.replicas)}"
                time.sleep(0.05)
            assert gateway.gateway.discovery.running == {}
            assert "phasegate_discovery_addresses{" not in httpx.get(f"{gateway.url}/metrics", timeout=10).text
            answer = gateway.openai().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert answer.choices[0].message.content
