"""The PostgreSQL event store: the contract, then what only PostgreSQL can show."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from app.store import EventStore, PostgresEventStore
from tests.app.store.contract import EventStoreContract


class TestPostgresEventStore(EventStoreContract):
    @pytest.fixture
    async def store(self, event_store: PostgresEventStore) -> AsyncIterator[EventStore]:
        yield event_store
