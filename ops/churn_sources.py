"""The churn soak's declared sources (ops/churn.py, docs/design.md §16): a DNS name whose
records change while traffic runs, and a configuration file reloaded (``SIGHUP``) with a
replica added and removed again; each change's propagation, timed.

DNS: dnsmasq on the loopback at a free port (``.ci/dnsmasq`` installs it), answering
``sim.churn.internal`` from a hosts file it reads again at its own ``SIGHUP``. Each
address is a sim worker of its own on ``127.0.0.N``, all at one port, as a headless
Service's pods are: a record added once its worker serves, removed later (its worker
stopped once the replica left). A reload writes the settings file with or without a
``[[replicas]]`` entry for one more worker and sends ``SIGHUP`` to every gateway instance.

Propagation: from the change (the DNS server's ``SIGHUP``, the gateways') until the admin
API lists the replica as serving (added) or no longer serving (removed), polled every
50 ms; the report prints the median and the worst of each.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import shutil
import signal
import socket
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

DOMAIN = "churn.internal"
NAME = f"sim.{DOMAIN}"
FILE_REPLICA = "f1"
POLL_S = 0.05


def dnsmasq_binary() -> str | None:
    found = os.environ.get("PHASEGATE_DNSMASQ") or shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
    return found if Path(found).exists() else None


def free_port() -> int:
    """A port free for UDP and TCP both, on the loopback (a DNS server takes both)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port = int(udp.getsockname()[1])
            with socket.socket() as tcp:
                try:
                    tcp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port


class Dns:
    """dnsmasq on the loopback, its records in a hosts file."""

    def __init__(self, binary: str, folder: Path) -> None:
        self.binary, self.folder, self.port = binary, folder, free_port()
        self.hosts = folder / "hosts"
        self.hosts.write_text("")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        command = [self.binary, "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts"]
        command += [f"--addn-hosts={self.hosts}", f"--local=/{DOMAIN}/", "--listen-address=127.0.0.1"]
        command += ["--bind-interfaces", f"--port={self.port}", "--pid-file=", "--cache-size=0"]
        command += [f"--user={pwd.getpwuid(os.getuid()).pw_name}", f"--group={grp.getgrgid(os.getgid()).gr_name}"]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("dnsmasq did not start")
            time.sleep(0.05)

    def records(self, addresses: list[str]) -> None:
        """``NAME`` answers ``addresses`` from now on (the server reads its file again)."""
        self.hosts.write_text("".join(f"{address} {NAME}\n" for address in addresses))
        if self.process is not None:
            self.process.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


def discover_table(dns: Dns, port: int) -> str:
    return f"""
[[discover]]
name = "{NAME}"
port = {port}
kind = "worker"
models = ["sim"]
every_s = 1
nameserver = "{dns.nameserver}"
drain_s = 5
"""


def replica_table(url: str) -> str:
    return f"""
[[replicas]]
id = "{FILE_REPLICA}"
url = "{url}"
kind = "worker"
"""


class Sources:
    """The DNS name's records and the file's replica, changed by turns from the churn's
    thread; the propagation of each change, timed on a thread of its own."""

    def __init__(
        self,
        dns: Dns,
        settings: Path,
        base_settings: str,
        start_worker: Callable[[str, int], subprocess.Popen[bytes]],
        stop_worker: Callable[[subprocess.Popen[bytes]], None],
        admin: Callable[[], list[dict[str, object]]],
        gateway_pids: Callable[[], list[int]],
    ) -> None:
        self.dns, self.settings, self.base_settings = dns, settings, base_settings
        self.start_worker, self.stop_worker, self.admin, self.gateway_pids = (
            start_worker,
            stop_worker,
            admin,
            gateway_pids,
        )
        self.port = free_port()  # every DNS address's worker listens on it, on an address of its own
        file_port = free_port()
        self.file_worker = start_worker("127.0.0.1", file_port)
        self.file_worker_url = f"http://127.0.0.1:{file_port}"
        self.workers: dict[str, subprocess.Popen[bytes]] = {}  # address -> its worker
        self.published: list[str] = []
        self.file_declared = False
        self.made: set[str] = set()  # the kinds of change made so far
        self.propagation: dict[str, list[float]] = {}
        self.errors: list[str] = []
        self._next = 10
        self._lock = threading.Lock()
        settings.write_text(self.settings_text())

    def replica_id(self, address: str) -> str:
        return f"{address}:{self.port}@{NAME}"

    def settings_text(self) -> str:
        extra = replica_table(self.file_worker_url) if self.file_declared else ""
        return self.base_settings + discover_table(self.dns, self.port) + extra

    def add_address(self) -> str:
        address = f"127.0.0.{self._next}"
        self._next += 1
        self.workers[address] = self.start_worker(address, self.port)
        self.published.append(address)
        self.dns.records(self.published)
        self._timed("dns add", self.replica_id(address), serving=True)
        return "dns add"

    def remove_address(self) -> str:
        address = self.published.pop(0)
        self.dns.records(self.published)
        self._timed("dns remove", self.replica_id(address), serving=False, then=self.workers.pop(address))
        return "dns remove"

    def reload(self) -> str:
        self.file_declared = not self.file_declared
        self.settings.write_text(self.settings_text())
        for pid in self.gateway_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGHUP)
        kind = "reload add" if self.file_declared else "reload remove"
        self._timed(kind, FILE_REPLICA, serving=self.file_declared)
        return kind

    def step(self, choose: Callable[[list[str]], str]) -> str:
        """One change: a DNS record added or removed, or the file reloaded; a kind of change
        not made yet comes first (a short or loaded run still makes each, as the churn's
        fleet changes do)."""
        options = ["dns add"] * (len(self.published) < 3) + ["dns remove"] * (len(self.published) > 1) + ["reload"]
        fresh = [option for option in options if self._kind(option) not in self.made]
        chosen = choose(fresh or options)
        if chosen == "dns add":
            kind = self.add_address()
        elif chosen == "dns remove":
            kind = self.remove_address()
        else:
            kind = self.reload()
        self.made.add(kind)
        return kind

    def _kind(self, option: str) -> str:
        if option == "reload":
            return "reload remove" if self.file_declared else "reload add"
        return option

    def _timed(self, kind: str, replica_id: str, *, serving: bool, then: subprocess.Popen[bytes] | None = None) -> None:
        changed = time.monotonic()

        def watch() -> None:
            deadline = changed + 60
            while time.monotonic() < deadline:
                try:
                    states = {str(r["id"]): r["state"] for r in self.admin()}
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    states = None
                if states is not None and (states.get(replica_id) == "serving") == serving:
                    with self._lock:
                        self.propagation.setdefault(kind, []).append(time.monotonic() - changed)
                    break
                time.sleep(POLL_S)
            else:
                self.errors.append(f"{kind} {replica_id}: not seen within 60 s")
            if then is not None:  # the removed address's worker: stopped once the replica left
                while time.monotonic() < deadline:
                    try:
                        if replica_id not in {str(r["id"]) for r in self.admin()}:
                            break
                    except (httpx.HTTPError, ValueError, KeyError, TypeError):
                        pass
                    time.sleep(0.5)
                self.stop_worker(then)

        threading.Thread(target=watch, daemon=True).start()

    def report(self) -> list[str]:
        lines = []
        for kind, seconds in sorted(self.propagation.items()):
            median, worst = statistics.median(seconds), max(seconds)
            lines.append(f"{kind:<14} {len(seconds):>4} changes  median {median:.2f} s  max {worst:.2f} s")
        return lines

    def close(self) -> None:
        for process in [*self.workers.values(), self.file_worker]:
            self.stop_worker(process)
        self.dns.stop()
