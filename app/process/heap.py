"""Freed memory handed back to the system, now and then.

A gateway's large short-lived buffers (request bodies, answers, the log's batches) come
from the C library's heap, and glibc keeps what is freed inside it: only the heap's top
goes back on its own, so a freed page below a live one stays resident. Under a fleet that
changes and traffic that comes and goes, the resident size then creeps up although the
live objects do not (docs/operations.md, "Soaks: chaos and churn"). ``malloc_trim(0)``
returns every whole free page of the heap; :func:`trim_every` calls it on a timer. On a
C library without it (musl, macOS) there is nothing to call, and nothing is done.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Callable

log = logging.getLogger("phasegate.heap")

TRIM_EVERY_S = 30.0  # its cost: one walk of the heap's free chunks (docs/performance.md)


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        function = ctypes.CDLL(None).malloc_trim  # the process's C library
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function


_TRIM = _malloc_trim()


def trim() -> bool:
    """Hand the heap's free pages back to the system: whether any went (``False``
    where the C library has no ``malloc_trim``)."""
    return _TRIM is not None and _TRIM(0) == 1


async def trim_every(interval_s: float = TRIM_EVERY_S) -> None:
    """:func:`trim` every ``interval_s``, until cancelled."""
    if _TRIM is None:
        log.debug("no malloc_trim in this C library: freed heap memory stays with the process")
        return
    while True:
        await asyncio.sleep(interval_s)
        trim()
