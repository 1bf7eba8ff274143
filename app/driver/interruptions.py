"""A request ended from outside its loop (app/driver/loop.py): a stop button, a drain, a
fenced instance. ``interrupt`` abandons the frame being awaited; the loop then ends the
request with the final error, recorded (a cancel, a drain) or not (a fenced instance,
whose log the sweeper closes with the same code)."""

from __future__ import annotations

import asyncio
from typing import Any, NamedTuple

from app.driver.actions import LoopActions
from app.driver.instance import with_advice
from app.driver.outputs import Failed, Output
from statemachine import events as ev
from statemachine.actions import CancelRequest
from statemachine.phases import Phase
from statemachine.policy import ended_by_gateway

CANCELLED_BY_CLIENT = "cancelled_by_client"  # RequestCancelled's reason for a stop button


class Interruption(NamedTuple):
    code: str
    message: str
    record: bool


class LoopInterruptions(LoopActions):
    """The loop's end from outside, over what the loop holds (:class:`LoopActions`)."""

    _interrupted: Interruption | None  # the gateway ends the request (drain, fenced)
    _pulling: asyncio.Task[Any] | None  # the task waiting for the next frame

    def interrupt(self, code: str, message: str, *, record: bool) -> None:
        """End the request now with the final error ``code``: recorded as
        ``RequestFailed`` (a drain), or not (a fenced instance, whose log the sweeper
        closes with the same code). The frame being awaited is abandoned."""
        if self._interrupted is not None or self.state.phase is Phase.TERMINATED:
            return
        self._interrupted = Interruption(code, message, record)
        if self._pulling is not None:
            self._pulling.cancel()

    async def _end_interrupted(self) -> Output:
        assert self._interrupted is not None
        code, message, record = self._interrupted
        run, self.run = self.run, None
        if record:
            if run is not None:
                self.recorder.record(ev.CancelSent, attempt=run.attempt, lease_epoch=run.lease_epoch)
                self.ctx.spawn(self._settle(run, fenced=False), name=f"cancel {self.request_id}/{run.attempt}")
            self.recorder.close_batch()
            if code == CANCELLED_BY_CLIENT:
                end = self._cancel_request(CancelRequest(CANCELLED_BY_CLIENT))
            else:
                said = with_advice(message, self.state.first_delta_sent)
                end = self._fail(ended_by_gateway(self.state, code, said))
            output = await end()
            assert output is not None
            return output
        delivered = self.recorder.delivered_output_tokens  # the log may lag: nothing more is written to it
        if run is not None:
            await run.release()  # its lease lapses unrenewed; the sweeper cancels it
        self.count_end("failed")
        self.ctx.drivers.pop(self.request_id, None)
        partial = delivered > 0 or self.state.first_delta_sent
        return Failed(code, with_advice(message, partial), partial, delivered, retryable=not partial, http_status=503)

    def count_end(self, outcome: str) -> None:
        raise NotImplementedError
