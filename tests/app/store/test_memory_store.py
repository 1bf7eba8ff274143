"""The in-memory event store passes the store's contract."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from app.store import EventStore, InMemoryEventStore
from tests.app.store.contract import EventStoreContract


class TestInMemoryEventStore(EventStoreContract):
    @pytest.fixture
    async def store(self) -> AsyncIterator[EventStore]:
        store = InMemoryEventStore()
        yield store
        await store.close()
