"""The event log (docs/design.md §8): append, read and follow request streams in PostgreSQL.

    store = await PostgresEventStore.connect(url)   # url: database_from_env()[0]
    await store.append(request_id, expected_version, events, durable=True)

See :mod:`app.store.base` for the interface, :mod:`app.store.errors` for the error
tree, ``migrations/`` for the schema and ``docs/audit.md`` for querying it.
"""

from app.store.base import EventStore, RequestInput, ToolExecution
from app.store.errors import InvalidAppend, StoreClosed, StoreError, StoreUnavailable, StreamConflict
from app.store.memory import InMemoryEventStore
from app.store.postgres import PostgresEventStore

__all__ = [
    "EventStore",
    "InMemoryEventStore",
    "InvalidAppend",
    "PostgresEventStore",
    "RequestInput",
    "StoreClosed",
    "StoreError",
    "StoreUnavailable",
    "StreamConflict",
    "ToolExecution",
]
