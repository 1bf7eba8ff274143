"""The suite's own helper for a thread's loop: nothing left open for the garbage collector
to warn about in a later test (tests/support/loops.py)."""

from __future__ import annotations

import asyncio
import gc
import socket
import warnings

from tests.support.loops import end_leftovers


def test_a_connection_left_open_is_closed_before_its_loop_closes() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    loop = asyncio.new_event_loop()
    try:

        async def leave_one_open() -> asyncio.StreamWriter:
            _, writer = await asyncio.open_connection(*listener.getsockname())
            return writer

        writer = loop.run_until_complete(leave_one_open())
        assert not writer.transport.is_closing()
        loop.run_until_complete(end_leftovers())
        assert writer.transport.is_closing()
    finally:
        loop.close()
        listener.close()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        del writer
        gc.collect()
    assert [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)] == []
