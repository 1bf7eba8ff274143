"""A stop signal while ``phasegate serve`` starts (app/process/start_signals.py): where its
``SystemExit`` lands in code that cannot raise, Python swallows it; the start's
unraisable hook keeps that quiet (the server stops on ``Deferred.received``), and reports
anything else as Python does."""

from __future__ import annotations

import signal
import sys
import weakref
from collections.abc import Iterator

import pytest

from app.process.start_signals import Deferred, quiet_swallowed_stop


class Thing:
    pass


@pytest.fixture
def start_hook() -> Iterator[None]:
    hook, received = sys.unraisablehook, Deferred.received
    sys.unraisablehook = quiet_swallowed_stop
    try:
        yield
    finally:
        sys.unraisablehook, Deferred.received = hook, received


def swallowed(error: BaseException) -> None:
    """``error`` raised in a weakref callback, which cannot raise: Python swallows it."""

    def callback(_: object) -> None:
        raise error

    thing = Thing()
    kept = weakref.ref(thing, callback)
    del thing
    assert kept() is None


def test_a_stop_swallowed_where_it_landed_is_not_reported(start_hook: None, capsys: pytest.CaptureFixture[str]) -> None:
    Deferred.received = signal.SIGINT
    swallowed(SystemExit(128 + signal.SIGINT))
    assert capsys.readouterr().err == ""


def test_anything_else_swallowed_is_reported_as_python_reports_it(
    start_hook: None, capsys: pytest.CaptureFixture[str]
) -> None:
    Deferred.received = signal.SIGINT
    swallowed(ValueError("a real fault"))
    Deferred.received = None
    swallowed(SystemExit(3))  # no stop signal received: not the start's stop
    err = capsys.readouterr().err
    assert "Exception ignored" in err and "ValueError: a real fault" in err and "SystemExit: 3" in err
