"""Fixtures of the store's tests (the shared ones are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[AsyncConnection]:
    """A SQLAlchemy connection to the test's database, for looking at what the store wrote."""
    engine = create_async_engine(database_url)
    try:
        async with engine.connect() as connection:
            yield connection
    finally:
        await engine.dispose()
