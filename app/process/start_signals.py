"""The stop and reload signals while ``phasegate serve`` starts (app/process/serve.py),
before its server takes them over: a stop unwinds the start as ``SystemExit`` (no
traceback, nothing left running), held until a start that must not be cut in two ends;
a reload asked meanwhile is counted, and applied once the gateway serves."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any


class Deferred:
    """Whether a stop signal now waits for the end of a start that must not be cut in two
    (a child started but not yet in the list of what to stop)."""

    holding = False
    pending: int | None = None
    # the stop signal received before the server took the signals over: its SystemExit
    # stops the start, but a library between the handler and this frame may swallow it
    # (a Ctrl-C in the migrations once left phasegate serving: test_serve), so the
    # server, once started, looks here too and stops at once
    received: int | None = None
    hangups = 0  # SIGHUPs received: reloads asked

    @classmethod
    def hangup(cls, signum: int, frame: object) -> None:
        cls.hangups += 1


def exit_on_signal(signum: int, frame: object) -> None:
    Deferred.received = signum
    if Deferred.holding:
        Deferred.pending = signum
        return
    raise SystemExit(128 + signum)


def quiet_swallowed_stop(unraisable: Any) -> None:
    """``sys.unraisablehook`` of the start: where a stop signal's ``SystemExit`` is raised
    in code that cannot raise (a weakref callback of the import system, a ``__del__``),
    Python swallows it and prints it as "Exception ignored" with a traceback. The stop is
    not lost (the server looks at :attr:`Deferred.received`), so it is not reported; any
    other unraisable exception is, as Python reports it."""
    if isinstance(unraisable.exc_value, SystemExit) and Deferred.received is not None:
        return
    sys.__unraisablehook__(unraisable)


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Hold a stop signal until the block ends, then act on it."""
    Deferred.holding = True
    try:
        yield
    except Exception:
        # A terminal sends Ctrl-C to the whole foreground group: pg_ctl or initdb got it
        # too and failed. That is the stop asked for, not an error to report.
        if Deferred.pending is None:
            raise
    finally:
        Deferred.holding = False
    if Deferred.pending is not None:
        raise SystemExit(128 + Deferred.pending)
