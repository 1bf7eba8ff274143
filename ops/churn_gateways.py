"""The churn soak's gateway instances (ops/churn.py): ``phasegate serve --sim-workers 0`` on
fixed ports, one of which is restarted during the run, and their resident memory.

A reload's ``SIGHUP`` goes only to an instance that serves (:meth:`Gateways.serving_pids`):
one sent to a process still starting, before Python has set its handlers, ends it, as it
ends any program. A restarted instance, once it serves, is sent one of its own, for a
file written while it started."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from ops.churn_traffic import MODEL
from ops.processes import free_port, phasegate, start, stop, wait_http


class Gateways:
    """Gateway instances on fixed ports; one can be restarted (a new instance, same port)."""

    def __init__(self, count: int, settings: Path, database_url: str, env: dict[str, str]) -> None:
        self.ports = [free_port() for _ in range(count)]
        serve = ["--log-level", "warning", "--model", MODEL, "--sim-workers", "0", "--config", str(settings)]
        self.commands = [phasegate("serve", "--processes", "1", "--port", str(p), *serve) for p in self.ports]
        self.env = {**env, "DATABASE_URL": database_url}
        # each instance's output (warnings and up), beside the settings, for a failed start
        self.logs = [settings.with_name(f"gateway-{n}.log") for n in range(count)]
        self.processes = [start(command, self.env, log) for command, log in zip(self.commands, self.logs, strict=True)]
        self.incarnations = [0] * count
        self.urls = [f"http://127.0.0.1:{port}" for port in self.ports]
        self.serving = [False] * count  # answered /readyz since it was last started

    def wait_ready(self) -> None:
        for index in range(len(self.urls)):
            self._wait_ready(index)

    def serving_pids(self) -> list[int]:
        """The instances a reload's ``SIGHUP`` may go to (above)."""
        return [p.pid for p, up in zip(self.processes, self.serving, strict=True) if up and p.poll() is None]

    def restart(self, index: int) -> None:
        self.serving[index] = False
        stop(self.processes[index], signal.SIGTERM, grace_s=30.0)
        self.processes[index] = start(self.commands[index], self.env, self.logs[index])
        self.incarnations[index] += 1
        self._wait_ready(index)
        os.kill(self.processes[index].pid, signal.SIGHUP)  # a reload written while it started

    def _wait_ready(self, index: int) -> None:
        try:
            wait_http(self.urls[index] + "/readyz", process=self.processes[index])
        except RuntimeError as exc:
            tail = self.logs[index].read_text(errors="replace").splitlines()[-20:]
            raise RuntimeError("\n".join([str(exc), f"the last lines of {self.logs[index]}:", *tail])) from None
        self.serving[index] = True

    def rss_kib(self, index: int) -> int:
        """The resident memory of the gateway's whole process group, from /proc."""
        group, total = self.processes[index].pid, 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[2]) != group:  # the process group id
                    continue
                status = Path(f"/proc/{entry}/status").read_text()
            except (OSError, ValueError, IndexError):
                continue
            total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        return total

    def close(self, sig: int = signal.SIGTERM) -> None:
        for process in self.processes:
            stop(process, sig, grace_s=30.0)
