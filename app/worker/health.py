"""Health: a real one-token generation through the engine (a pooling request where it only
pools), reused for a short while.

Concurrent checks share one probe in flight; a result is reused for ``ttl_s`` so that a
pool polling many replicas does not load the engines. The probe bypasses the worker's
queue and leases (it is the engine's health, not an attempt) but not the engine's own
scheduler, so a saturated engine answers slowly, as it should.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

from app.worker.engine import Engine
from app.worker.protocol import AttemptSpec, Sampling

_probe_ids = itertools.count(1)


class HealthProbe:
    def __init__(self, engine: Engine, ttl_s: float, timeout_s: float) -> None:
        self.engine = engine
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self._result: tuple[bool, dict[str, Any]] | None = None
        self._at = 0.0
        self._inflight: asyncio.Task[tuple[bool, dict[str, Any]]] | None = None

    async def check(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, details); details say whether the answer was cached and how old it is."""
        now = time.monotonic()
        if self._result is not None and now - self._at < self.ttl_s:
            ok, details = self._result
            return ok, {**details, "cached": True, "age_ms": round((now - self._at) * 1000)}
        if self._inflight is None:
            self._inflight = asyncio.get_running_loop().create_task(self._probe())
            self._inflight.add_done_callback(self._store)
        ok, details = await asyncio.shield(self._inflight)
        return ok, {**details, "cached": False, "age_ms": 0}

    def _store(self, task: asyncio.Task[tuple[bool, dict[str, Any]]]) -> None:
        self._inflight = None
        if not task.cancelled() and task.exception() is None:
            self._result = task.result()
            self._at = time.monotonic()

    async def _probe(self) -> tuple[bool, dict[str, Any]]:
        spec = _probe_spec(self.engine, self.timeout_s)
        engine_request_id = f"health#{next(_probe_ids)}"
        started = time.monotonic()
        tokens = 0
        answered = False
        try:
            prepared = await self.engine.prepare(spec)
            async with asyncio.timeout(self.timeout_s):
                async for output in self.engine.generate(engine_request_id, prepared):
                    tokens += len(output.token_ids)
                    answered = answered or output.answer is not None
        except TimeoutError:
            await self.engine.abort(engine_request_id)
            return False, {"error": f"no token within {self.timeout_s} s"}
        except Exception as exc:
            return False, {"error": repr(exc)}
        probe_ms = round((time.monotonic() - started) * 1000, 1)
        if tokens < 1 and not answered:
            return False, {"error": "the engine produced no token", "probe_ms": probe_ms}
        return True, {"probe_ms": probe_ms, "tokens": tokens}


def _probe_spec(engine: Engine, timeout_s: float) -> AttemptSpec:
    """The probe: one token of a generation, or where the engine only pools (a pooling
    model's: docs/design.md §17) a pooling request on ``/pooling``, which vLLM serves for
    every pooling model (its default task)."""
    if not engine.generates:
        pooled = {"input": "health check"}
        model = engine.models[0]
        return AttemptSpec("health", 1, 0, timeout_s, model, None, None, Sampling(), 1.0, pooled, (), "/pooling")
    fields = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    sampling = Sampling(max_tokens=1, temperature=0.0, ignore_eos=True)
    return AttemptSpec("health", 1, 0, timeout_s, engine.models[0], None, "health check", sampling, 1.0, fields)
