"""A real gateway for tests: uvicorn on a socket bound to a free port, in a thread with its own loop.

The gateway talks to real worker processes and real PostgreSQL; tests talk to it
over real sockets (the ``openai`` client, httpx, raw SSE). Running it in-process
lets a test read the log through the gateway's own store and wait for its
background bookkeeping::

    with running_gateway(database_url, [worker_a, worker_b]) as gateway:
        client = gateway.openai()
        ...
        events = gateway.events(request_id)
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import openai
import uvicorn

from app.config import GatewayConfig, ReplicaConfig, load_config
from app.driver.context import ToolRunner
from app.http.server import server_config
from app.process.gateway import Gateway
from ops.processes import listening_socket
from statemachine.events import Event
from tests.support.loops import end_leftovers, stopped, task_stacks

T = TypeVar("T")

MODEL = "sim"
REVISION = "sim-rev-1"


@dataclass
class RunningGateway:
    gateway: Gateway
    loop: asyncio.AbstractEventLoop
    url: str
    config: GatewayConfig
    clients: list[openai.OpenAI] = field(default_factory=list)  # closed with the gateway

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run ``coroutine`` on the gateway's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def openai(self, **options: Any) -> openai.OpenAI:
        options.setdefault("api_key", "test-key")
        options.setdefault("max_retries", 0)
        options.setdefault("timeout", 30.0)
        client = openai.OpenAI(base_url=f"{self.url}/v1", **options)
        self.clients.append(client)
        return client

    def http(self, **options: Any) -> httpx.Client:
        options.setdefault("timeout", 30.0)
        return httpx.Client(base_url=self.url, **options)

    def settle(self, timeout: float = 60.0) -> None:
        """Wait until no request is in flight and no bookkeeping is pending, then flush the log."""
        ctx = self.gateway.ctx
        deadline = time.monotonic() + timeout
        while ctx.drivers or ctx.background:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"still busy after {timeout}s: {sorted(ctx.drivers)} {ctx.background}\n"
                    f"their events so far: {self._names_logged(list(ctx.drivers))}\n"
                    f"the loop's tasks:\n{task_stacks(self.loop)}"
                )
            time.sleep(0.02)
        self.call(ctx.store.flush())

    def _names_logged(self, request_ids: list[str]) -> dict[str, list[str]] | str:
        try:
            read = {rid: self.call(self.gateway.ctx.store.read(rid), 5.0) for rid in request_ids}
            return {rid: [type(e).__name__ for e in events] for rid, events in read.items()}
        except Exception as exc:  # a loop that does not answer: the stacks below say why
            return f"unread ({exc!r})"

    def events(self, request_id: str) -> list[Event]:
        """The request's committed events, after its bookkeeping settled."""
        self.settle()
        return self.call(self.gateway.ctx.store.read(request_id))

    def logged(self, request_id: str) -> list[Event]:
        """The request's events committed so far, without waiting for it to end."""
        return self.call(self.gateway.ctx.store.read(request_id))

    def wait_logged(self, request_id: str, condition: Callable[[list[Event]], object], timeout: float = 30.0) -> None:
        """Wait until the request's log meets ``condition``: a loaded machine only makes it later."""
        deadline = time.monotonic() + timeout
        while not condition(events := self.logged(request_id)):
            assert time.monotonic() < deadline, [type(e).__name__ for e in events]
            time.sleep(0.02)

    def metric(self, name: str, **labels: str) -> float:
        value = self.gateway.ctx.metrics.registry.get_sample_value(name, labels)
        return value or 0.0


@contextlib.contextmanager
def running_gateway(
    database_url: str,
    replicas: Sequence[ReplicaConfig | Any],
    *,
    tool_runner: ToolRunner | None = None,
    **overrides: Any,
) -> Iterator[RunningGateway]:
    """A gateway over ``replicas`` (ReplicaConfigs, or objects with ``base_url``)."""
    configs = tuple(
        r if isinstance(r, ReplicaConfig) else ReplicaConfig(id=f"w{i}", url=r.base_url)
        for i, r in enumerate(replicas, start=1)
    )
    overrides.setdefault("models", {MODEL: REVISION})
    overrides.setdefault("health_interval_s", 0.5)
    # the instance's lease is not what these gateways test (tests of it set their own): a
    # loaded machine that starves the loop for 5 s must not fence it mid-test (docs/design.md §11)
    overrides.setdefault("instance_lease_ttl_s", 60.0)
    # the fault tests say which replica an attempt meets: the least loaded, ties to the first
    # listed; the default strategy (prefix affinity, docs/routing.md) has tests of its own
    overrides.setdefault("routing", {"strategy": "least_outstanding"})
    listener = listening_socket()
    config = load_config(None, port=listener.getsockname()[1], replicas=configs, apply_migrations=False, **overrides)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict[str, Any] = {}

    async def serve() -> None:
        try:
            gateway = await Gateway.open(config, database_url, tool_runner=tool_runner)
            server = uvicorn.Server(
                server_config(  # as phasegate serve
                    gateway.app,
                    config.http_limits,
                    host="127.0.0.1",
                    port=config.port,
                    log_level="warning",
                    lifespan="on",
                )
            )
            holder.update(gateway=gateway, server=server)
            serving = asyncio.ensure_future(server.serve(sockets=[listener]))
            while not server.started and not serving.done():
                await asyncio.sleep(0.01)
            started.set()
            await serving
        except BaseException as exc:
            holder["error"] = exc
            started.set()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    started.wait(60)
    if "error" in holder:
        # its loop closed here, not by the garbage collector in whichever test runs next,
        # where the ResourceWarning would fail that test
        thread.join(30)
        loop.run_until_complete(asyncio.sleep(0.05))  # transports of a cancelled connect close
        loop.run_until_complete(end_leftovers())
        loop.close()
        listener.close()
        raise RuntimeError("the gateway did not start") from holder["error"]
    running = RunningGateway(holder["gateway"], loop, f"http://127.0.0.1:{config.port}", config)
    try:
        yield running
    finally:
        for client in running.clients:
            client.close()
        holder["server"].should_exit = True
        stopped(thread, loop, "the gateway")
        loop.run_until_complete(end_leftovers())  # e.g. sse-starlette's shutdown watcher
        loop.close()
        listener.close()
