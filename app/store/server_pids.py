"""The embedded server's processes seen by their pids (app/store/embedded.py): a pid file
read, and whether a pid is still a PostgreSQL, one on its way out, another program's, or
gone."""

from __future__ import annotations

import os
from pathlib import Path


def read_pid(path: Path) -> int | None:
    try:
        first = path.read_text().split("\n", 1)[0].strip()
    except (FileNotFoundError, PermissionError):
        return None
    return int(first) if first.isdigit() else None


def process_state(pid: int) -> str:
    """``gone``, ``zombie`` (or exiting), ``postgres`` or ``other`` (a pid reused by another program)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        pass
    proc = Path(f"/proc/{pid}")
    if not proc.exists():
        return "postgres"  # no /proc to ask (not Linux): trust the pid
    try:
        # A stopped postmaster is nobody's child here: it stays a zombie until init
        # reaps it, which in some containers takes a second or more. A process on its
        # way out has already lost its command line.
        cmdline = (proc / "cmdline").read_bytes()
        if not cmdline or (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return "zombie"
        return "postgres" if b"postgres" in cmdline else "other"
    except (OSError, IndexError):
        return "gone"


def alive(pid: int) -> bool:
    return process_state(pid) not in ("gone", "zombie")
