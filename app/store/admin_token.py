"""The embedded default's admin token: one per data directory, kept there, stable across starts.

``phasegate serve`` with nothing configured prints a URL with the admin token that opens the
list of requests; a token made anew at every start broke that URL's bookmark and its cookie
at each restart. So the embedded default keeps its token in ``<data dir>/admin-token``
(mode 0600, made on first use) and prints it at every start; ``phasegate admin-token``
prints it, and ``--rotate`` replaces it (a running gateway takes the new one when it starts
again).
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path
from typing import Any

from app.store.data_dir import DATA_DIR_ENV, default_data_dir

FILE = "admin-token"


def token_file(data_dir: Path | str | None = None) -> Path:
    return Path(data_dir or os.environ.get(DATA_DIR_ENV) or default_data_dir()) / FILE


def stable_admin_token(data_dir: Path | str | None = None, *, rotate: bool = False) -> str:
    """The data directory's admin token: read, or made (mode 0600) when there is none or ``rotate``."""
    path = token_file(data_dir)
    if not rotate:
        try:
            token = path.read_text().strip()
            if token:
                path.chmod(0o600)  # a copy restored with looser permissions is closed again
                return token
        except FileNotFoundError:
            pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    token = secrets.token_urlsafe(24)
    partial = path.with_name(FILE + ".new")
    partial.unlink(missing_ok=True)
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as written:
        written.write(token + "\n")
    partial.replace(path)
    return token


def add_admin_token_parser(subparsers: Any) -> None:
    command = subparsers.add_parser(
        "admin-token",
        help="print the embedded default's admin token (--rotate: replace it)",
        description=f"The admin token phasegate serve uses when none is configured, kept in ${DATA_DIR_ENV}/{FILE} "
        "(mode 0600). A running gateway takes a rotated token when it starts again.",
    )
    command.add_argument("--rotate", action="store_true", help="replace the token with a new one")
    command.set_defaults(run=run_admin_token_command)


def run_admin_token_command(args: argparse.Namespace) -> int:
    print(stable_admin_token(rotate=args.rotate))
    return 0
