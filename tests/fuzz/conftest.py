"""The fuzz suite's running parts and its tally.

- ``stack`` (package): a real sim worker that requires its token, and a real
  ``phasegate serve`` over it on real PostgreSQL, with an API key and an admin token, and
  small limits (``max_tokens`` 16) so that an accepted request is quick;
- ``tally`` (package): every case's family and status, printed at the end of the run as
  one line per family (cases and a status histogram), for the note;
- :func:`fuzz_settings`: Hypothesis settings with ``PHASEGATE_FUZZ_EXAMPLES`` examples a
  property (default 60: under a minute on two cores; 1000, about 17 minutes, for a
  longer hunt); schemathesis's properties, one an operation of ``/openapi.json`` and a
  mode, take :data:`SCHEMA_EXAMPLES` (default 20: its case generation is most of the
  suite's single longest module; the same variable asks for more).
"""

from __future__ import annotations

import asyncio
import collections
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import asyncpg
import httpx
import pytest
from hypothesis import HealthCheck, settings

from app.store.database import asyncpg_dsn
from tests.support.served import ServedGateway, served_gateway
from tests.support.workers import WorkerProcess, running_worker

EXAMPLES = int(os.environ.get("PHASEGATE_FUZZ_EXAMPLES", "60"))
SCHEMA_EXAMPLES = int(os.environ.get("PHASEGATE_FUZZ_EXAMPLES", "20"))
WORKER_TOKEN = "fuzz-worker-token-0123456789"
API_KEY = "fuzz-api-key-0123456789"
ADMIN_TOKEN = "fuzz-admin-token-0123456789"
MODEL = "sim"
MAX_TOKENS = 16
# a server-side failure in its own output; refusals log at INFO/WARNING without a traceback
SERVER_FAULTS = ("Traceback", "Exception in ASGI application", "Internal Server Error")


def fuzz_settings(examples: int = EXAMPLES) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,  # no .hypothesis/ in the tree; a failure prints its example
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


@dataclass
class Tally:
    """Cases per family and their statuses, plus the ids of the requests the gateway accepted."""

    statuses: dict[str, collections.Counter[int]] = field(default_factory=dict)
    accepted: set[str] = field(default_factory=set)

    def record(self, family: str, status: int) -> None:
        self.statuses.setdefault(family, collections.Counter())[status] += 1

    def lines(self) -> list[str]:
        return [
            f"fuzz {family}: {sum(counts.values())} cases, statuses "
            + ", ".join(f"{status}: {n}" for status, n in sorted(counts.items()))
            for family, counts in sorted(self.statuses.items())
        ]


_TALLY = Tally()


@pytest.fixture(scope="package")
def tally() -> Tally:
    return _TALLY


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _TALLY.statuses:
        terminalreporter.section(f"fuzz: cases per family and statuses ({EXAMPLES} examples a property)")
        for line in _TALLY.lines():
            terminalreporter.write_line(line)


@dataclass
class Stack:
    gateway: ServedGateway
    worker: WorkerProcess
    database_url: str

    def gateway_client(self) -> httpx.Client:
        return httpx.Client(base_url=self.gateway.url, timeout=30)

    def worker_client(self) -> httpx.Client:
        return httpx.Client(base_url=self.worker.base_url, timeout=30)

    def server_faults(self) -> list[str]:
        """Lines of either server's output that show a failure of its own."""
        text = self.gateway.logs() + self.worker.logs()
        return [line for line in text.splitlines() if any(fault in line for fault in SERVER_FAULTS)]

    def log_apart_from(self, request_ids: set[str]) -> tuple[int, int]:
        """Events in the log and rows of the ``requests`` read model, of requests other than ``request_ids``."""
        ids = list(request_ids)
        events = self._count("SELECT count(*) FROM request_events WHERE request_id <> ALL($1::text[])", ids)
        return events, self._count("SELECT count(*) FROM requests WHERE request_id <> ALL($1::text[])", ids)

    def events_of(self, request_id: str) -> int:
        return self._count("SELECT count(*) FROM request_events WHERE request_id = $1", request_id)

    def failed_with(self, request_id: str, code: str) -> int:
        """Whether the log ends the request as failed with ``code`` (1) or not (0)."""
        sql = "SELECT count(*) FROM request_events WHERE request_id = $1 AND type = 'RequestFailed'"
        sql += " AND body->>'code' = $2"
        return self._count(sql, request_id, code)

    def _count(self, sql: str, *args: object) -> int:
        async def run() -> int:
            connection = await asyncpg.connect(asyncpg_dsn(self.database_url))
            try:
                return int(await connection.fetchval(sql, *args))
            finally:
                await connection.close()

        return asyncio.run(run())


@pytest.fixture(scope="package")
def stack(package_database_url: str) -> Iterator[Stack]:
    args = ["--model", MODEL, "--sim-decode-ms-per-token", "0.5", "--max-running", "16", "--max-model-len", "4096"]
    with running_worker(args=args, token=WORKER_TOKEN) as worker:
        settings_ = {
            "api_keys": {API_KEY: "fuzz"},
            "admin_token": ADMIN_TOKEN,
            "limits": {"max_tokens": MAX_TOKENS, "default_max_tokens": 4},
        }
        with served_gateway(package_database_url, worker, settings=settings_) as gateway:
            yield Stack(gateway, worker, package_database_url)
