"""A PostgreSQL primary and its synchronous streaming standby, from the embedded binaries.

How this works: the primary is an :class:`~app.store.embedded.EmbeddedPostgres` that also
listens on a TCP port of 127.0.0.1, with ``wal_level=replica`` and
``synchronous_standby_names='*'``, so a commit returns only once a standby has flushed
its WAL. The standby's data directory is a ``pg_basebackup -R`` of the primary (the
``-R`` writes ``standby.signal`` and ``primary_conninfo``), started as another
EmbeddedPostgres on its own port. :meth:`ReplicaPair.kill_primary` SIGKILLs the
primary's postmaster and every backend of it, as a lost machine would;
:meth:`ReplicaPair.promote` makes the standby the primary (``pg_ctl promote``). The
promoted standby has no ``synchronous_standby_names``: alone, it must not wait for a
standby that is not there (Patroni and CloudNativePG relax it the same way, unless told
to be strict).

:attr:`ReplicaPair.url` names both hosts, libpq-style, with
``target_session_attrs=read-write``: what a gateway is given as ``DATABASE_URL``.
Used by the failover test (tests/faults/test_failover.py) and by
``ops/bench/eventlog.py --standby``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg

from app.store.embedded import SERVER_USER, EmbeddedPostgres


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


class ReplicaPair:
    """A primary and a synchronous standby on ``127.0.0.1``, in ``root``; see the module docstring.

    ``settings`` go to both servers (``fsync=off`` for tests); ``synchronous``: whether the
    primary waits for the standby at each commit (``False``: asynchronous streaming)."""

    def __init__(
        self,
        root: Path,
        primary_port: int,
        standby_port: int,
        *,
        settings: dict[str, str] | None = None,
        synchronous: bool = True,
    ) -> None:
        self.root = root
        self.ports = (primary_port, standby_port)
        common = {"listen_addresses": "127.0.0.1", "wal_level": "replica", "max_wal_senders": "4"}
        common |= settings or {}
        primary = {**common, "port": str(primary_port)}
        if synchronous:
            primary["synchronous_standby_names"] = "*"
        self.primary = EmbeddedPostgres(root / "primary", settings=primary)
        self.standby = EmbeddedPostgres(root / "standby", settings={**common, "port": str(standby_port)})

    def url(self, database: str = "postgres") -> str:
        """Both hosts, the primary first; a client keeps the one that takes writes."""
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.ports)
        return f"postgresql://postgres@{hosts}/{database}?target_session_attrs=read-write"

    def node_url(self, node: int, database: str = "postgres") -> str:
        """One node alone (0: the first primary, 1: the standby)."""
        return f"postgresql://postgres@127.0.0.1:{self.ports[node]}/{database}"

    def start(self) -> None:
        """Start the primary, clone it, start the standby and wait until it is synchronous."""
        self.primary.start()
        self._clone()
        self.standby.start()
        self._wait_streaming()

    def stop(self) -> None:
        for server in (self.standby, self.primary):
            with contextlib.suppress(Exception):
                server.stop(mode="immediate")

    def kill_primary(self) -> None:
        """SIGKILL the primary's postmaster and its processes: no shutdown, no goodbye."""
        pid = int((self.primary.pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
        backends = _children(pid)
        for victim in (pid, *backends):
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{p}").exists() and _state(p) not in ("Z", "X") for p in (pid, *backends)):
            if time.monotonic() > deadline:
                raise RuntimeError("the primary's processes outlived SIGKILL")
            time.sleep(0.01)
        self.primary.owns_server = False  # nothing left to stop

    def promote(self) -> None:
        """Make the standby the primary; returns once it takes writes."""
        self._as_server_user("pg_ctl", "promote", "-w", "-t", "60", "-D", str(self.standby.pgdata))

    # --- internals ---------------------------------------------------------------------

    def _clone(self) -> None:
        data_dir = self.standby.data_dir
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
        data_dir.chmod(0o755)
        for path in (self.standby.pgdata, self.standby.socket_dir, self.standby.log_file.parent):
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._chown(path)
        self._as_server_user(
            "pg_basebackup",
            *("-h", "127.0.0.1", "-p", str(self.ports[0]), "-U", "postgres"),
            *("-D", str(self.standby.pgdata), "-R", "-X", "stream", "-c", "fast"),
        )

    def _wait_streaming(self, timeout: float = 60.0) -> None:
        async def state() -> str | None:
            connection = await asyncpg.connect(self.node_url(0))
            try:
                value: str | None = await connection.fetchval("SELECT sync_state FROM pg_stat_replication LIMIT 1")
                return value
            finally:
                await connection.close()

        wanted = "sync" if "synchronous_standby_names" in self.primary.settings else "async"
        deadline = time.monotonic() + timeout
        while asyncio.run(state()) != wanted:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the standby did not become {wanted} within {timeout:g} s")
            time.sleep(0.1)

    def _user(self) -> pwd.struct_passwd | None:
        return pwd.getpwnam(SERVER_USER) if os.geteuid() == 0 else None

    def _chown(self, path: Path) -> None:
        user = self._user()
        if user is not None:
            os.chown(path, user.pw_uid, user.pw_gid)

    def _as_server_user(self, program: str, *args: str) -> None:
        user = self._user()
        as_user: dict[str, object] = {}
        if user is not None:
            as_user = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        result = subprocess.run(
            [str(self.primary.bin_dir / program), *args],
            cwd=self.root,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            **as_user,  # type: ignore[call-overload]
        )
        if result.returncode != 0:
            raise RuntimeError(f"{program} failed: {result.stdout}{result.stderr}")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


@contextlib.contextmanager
def replica_pair(root: Path, primary_port: int, standby_port: int, **options: object) -> Iterator[ReplicaPair]:
    """A started :class:`ReplicaPair`, stopped (both servers) on leaving."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    pair = ReplicaPair(root, primary_port, standby_port, **options)  # type: ignore[arg-type]
    try:
        pair.start()
        yield pair
    finally:
        pair.stop()
