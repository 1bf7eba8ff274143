"""A worker that joins the fleet by itself (``--join URL``; docs/worker-protocol.md).

Once its engine is ready it registers with the gateway at ``--join`` under the worker
token, declaring its id, a new incarnation (this process), the URL the gateway reaches
it at (``--advertise``, else its listen address) and each model's revision
(``--model NAME=REV``). It renews its lease every ``RENEW_EVERY_S``; told it is no
member (it lapsed while cut off, or an operator removed it), it joins again. A drain
(SIGTERM) cordons it first, so no new attempt comes while the running ones finish, and
it leaves at its exit. A gateway that cannot be reached is tried again every half second: the
worker serves whoever already knows it meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid
from typing import Any

import httpx

from app.contract.fleet_join import CORDON_PATH, JOIN_PATH, LEAVE_PATH, NOT_MEMBER, RENEW_EVERY_S, RENEW_PATH

log = logging.getLogger("phasegate.worker")

RETRY_S = 0.5
CALL_S = 10.0  # the gateway probes a joining worker (a real generation) before it answers


def advertised(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


class Joiner:
    def __init__(
        self, gateway: str, replica_id: str, url: str, models: dict[str, str | None], token: str | None
    ) -> None:
        self.gateway = gateway.rstrip("/")
        self.replica_id = replica_id
        self.url = url
        self.models = models
        self.incarnation = uuid.uuid4().hex[:16]
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(base_url=self.gateway, headers=headers, timeout=CALL_S)
        self.joined = asyncio.Event()
        self._draining = False

    @property
    def identity(self) -> dict[str, Any]:
        return {"id": self.replica_id, "incarnation": self.incarnation}

    async def run(self) -> None:
        """Join, then renew until cancelled (joining again whenever told it is no member)."""
        while True:
            if not self.joined.is_set() and not self._draining:
                await self._join()
            elif self.joined.is_set():
                await self._renew()
            await asyncio.sleep(RENEW_EVERY_S if self.joined.is_set() else RETRY_S)

    async def _join(self) -> None:
        body = {**self.identity, "url": self.url, "models": self.models}
        answer = await self._post(JOIN_PATH, body)
        if answer is not None and answer.status_code == 201:
            self.joined.set()
            log.warning("worker %s joined the fleet through %s as %s", self.replica_id, self.gateway, self.url)
        elif answer is not None:
            log.error(
                "worker %s: joining %s refused: %s %s", self.replica_id, self.gateway, answer.status_code, answer.text
            )

    async def _renew(self) -> None:
        answer = await self._post(RENEW_PATH, self.identity)
        if answer is not None and answer.status_code == 404 and NOT_MEMBER in answer.text:
            log.warning("worker %s is no member of the fleet any more: joining again", self.replica_id)
            self.joined.clear()

    async def cordon(self) -> None:
        """Draining: no new attempt for it, from every gateway instance within a second."""
        self._draining = True
        if self.joined.is_set():
            await self._post(CORDON_PATH, self.identity)

    async def leave(self) -> None:
        if self.joined.is_set():
            await self._post(LEAVE_PATH, self.identity)
            self.joined.clear()
        await self._http.aclose()

    async def _post(self, path: str, body: dict[str, Any]) -> httpx.Response | None:
        try:
            return await self._http.post(path, json=body)
        except httpx.HTTPError as exc:
            log.warning("worker %s: %s%s: %r", self.replica_id, self.gateway, path, exc)
            return None


async def stop(task: asyncio.Task[None] | None, joiner: Joiner | None) -> None:
    """End the renewals and leave the fleet (at the worker's exit)."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if joiner is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(joiner.leave(), 5)
