"""Where the embedded default keeps everything (app/store/embedded.py): ``$PHASEGATE_DATA_DIR``,
else a default that depends on who runs it."""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "PHASEGATE_DATA_DIR"
DEFAULT_DATA_DIR = Path("/var/lib/phasegate")  # as root


def default_data_dir() -> Path:
    """``/var/lib/phasegate`` for root; for anyone else, where their data lives
    (``$XDG_DATA_HOME/phasegate``, else ``~/.local/share/phasegate``): a user may not
    write to /var/lib, and only root's server needs a path away from the home folder."""
    if os.geteuid() == 0:
        return DEFAULT_DATA_DIR
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "phasegate"
