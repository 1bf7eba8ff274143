"""Fixtures of the incident tools' tests: the real ``phasegate`` command line on a real database.

- ``phasegate(*argv)``: runs ``app.cli.main`` in this process with ``DATABASE_URL`` set to
  the test's fresh database; returns the exit status and what it printed.
- ``offline(*argv)``: the same with ``DATABASE_URL`` pointing at a port where nothing
  listens, so a command that touched the database would fail.
- ``seed(*traces)``: appends events to the test's database through the real store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest

from app.cli import main
from app.store.postgres import PostgresEventStore
from statemachine.events import Event
from tests.conftest import run_sync

NOWHERE = "postgresql://nobody@127.0.0.1:9/nothing"


@dataclass
class Ran:
    status: int
    out: str
    err: str


Runner = Callable[..., Ran]


def _runner(capsys: pytest.CaptureFixture[str]) -> Runner:
    def run(*argv: str) -> Ran:
        capsys.readouterr()  # forget anything printed before
        status = main(list(argv))
        captured = capsys.readouterr()
        return Ran(status, captured.out, captured.err)

    return run


@pytest.fixture
def phasegate(database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Runner:
    monkeypatch.setenv("DATABASE_URL", database_url)
    return _runner(capsys)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Runner:
    monkeypatch.setenv("DATABASE_URL", NOWHERE)
    return _runner(capsys)


@pytest.fixture
def seed(database_url: str) -> Callable[[Sequence[Sequence[Event]]], None]:
    def append(streams: Sequence[Sequence[Event]]) -> None:
        async def write() -> None:
            store = await PostgresEventStore.connect(database_url)
            try:
                for events in streams:
                    await store.append(events[0].request_id, 0, list(events))
            finally:
                await store.close()

        run_sync(write)

    return append
