"""vLLM's beam search in the worker, run as ``vllm serve`` runs it, with an abort the worker
can confirm (docs/design.md §7: a worker replica's cancel is acknowledged only once the engine
stopped).

``use_beam_search`` is not one engine request: vLLM's server runs its
``BeamSearchOnlineMixin.beam_search``, which asks the engine for one token a beam and a
step, each under an id it draws itself, and yields the best beams once at the end. So the
worker runs a search in a task of its own, and its abort cancels that task and waits for it:
cancelling it cancels the step's engine requests, each of which vLLM aborts in the engine
before its generator ends, so once the task ended no engine request of the search runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any


class BeamSearches:
    """The beam searches running on one engine, by the attempt's engine request id."""

    def __init__(self, llm: Any) -> None:
        from vllm.entrypoints.generate.beam_search.online import (  # type: ignore[import-not-found, unused-ignore]
            BeamSearchOnlineMixin,
        )

        class _BeamServer(BeamSearchOnlineMixin):  # type: ignore[misc, unused-ignore]
            """What vLLM's beam search reads of its server: the renderer and the engine."""

            def __init__(self) -> None:
                self.renderer = llm.renderer
                self.engine_client = llm

        self._server = _BeamServer()
        self._running: dict[str, asyncio.Task[list[Any]]] = {}

    async def outputs(self, engine_input: Any, request_id: str, params: Any) -> AsyncGenerator[Any, None]:
        """The search's outputs (vLLM's: one, the best beams, at its end); closing this
        stops the search, as :meth:`abort` does."""
        task = asyncio.ensure_future(self._searched(engine_input, request_id, params))
        self._running[request_id] = task
        try:
            for output in await task:
                yield output
        finally:
            await self.abort(request_id)

    async def _searched(self, engine_input: Any, request_id: str, params: Any) -> list[Any]:
        return [output async for output in self._server.beam_search(engine_input, request_id, params)]

    async def abort(self, request_id: str) -> bool:
        """Stop the search of ``request_id`` and wait until none of its engine requests runs;
        False when no search runs under that id."""
        task = self._running.pop(request_id, None)
        if task is None:
            return False
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return True
