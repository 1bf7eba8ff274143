"""The worker client's errors, each mapped onto the :class:`FailureKind` the driver records.

Each error carries ``kind`` and ``released``: whether the error itself proves the
attempt will publish nothing more (so the driver need not fence it)::

    WorkerError                (an UpstreamFailure of app/replicas/base.py: what the driver catches)
    ├── ReplicaExited          replica_exited, released: the process is gone or going
    │   ├── ConnectFailed        connection refused: nothing listens there
    │   ├── StreamBroken         connection reset, or EOF before a done or error frame
    │   └── ReplicaExiting       503 replica_exiting, or an error frame replica_exiting
    ├── LivenessUncertain      liveness_uncertain, not released: fence before a retry
    │   ├── ConnectTimedOut      no TCP connection within the connect timeout
    │   ├── ReadStalled          no frame within the read timeout
    │   ├── MalformedFrame       a line that is not a protocol frame
    │   └── ControlUnanswered    renew or cancel unanswered in time, or 504 abort_unconfirmed
    ├── Rejected               rejected: refused before starting (429, 503, 5xx); retry_after
    │   └── TokenRefused         401 on any call: the gateway's worker_token is not the worker's
    ├── RequestRefused         request_refused: a 4xx on the start request itself
    └── AttemptEnded           replica_exited, released: the worker ended the attempt itself
        │                        (error frame lease_expired, lease_revoked, cancelled, engine_error)
        └── LeaseLost            renew refused (unknown_attempt, lease_expired, …); a stale
                                 epoch is the one case that is not released

:func:`transport_error` says which of them an httpx failure is, and :func:`error_fields`
reads a worker's error answer. ``overloaded`` is not here: it is the driver's reading of
heartbeats over time, not something one call observes.
"""

from __future__ import annotations

import json

import httpx

from app.replicas.base import UpstreamFailure
from statemachine.events import FailureKind


class WorkerError(UpstreamFailure):
    """Base of every error the client raises; see the tree in the module docstring.

    An :class:`UpstreamFailure`, so the driver records it without knowing the client.
    """

    kind: FailureKind
    released = False

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None) -> None:
        super().__init__(type(self).kind, message, status=status, code=code)
        self.message = message


class ReplicaExited(WorkerError):
    kind = FailureKind.REPLICA_EXITED
    released = True


class ConnectFailed(ReplicaExited):
    pass


class StreamBroken(ReplicaExited):
    pass


class ReplicaExiting(ReplicaExited):
    pass


class LivenessUncertain(WorkerError):
    kind = FailureKind.LIVENESS_UNCERTAIN


class ConnectTimedOut(LivenessUncertain):
    pass


class ReadStalled(LivenessUncertain):
    pass


class MalformedFrame(LivenessUncertain):
    def __init__(self, message: str, *, line: bytes) -> None:
        super().__init__(message)
        self.line = line


class ControlUnanswered(LivenessUncertain):
    pass


class Rejected(WorkerError):
    kind = FailureKind.REJECTED
    released = True

    def __init__(self, message: str, *, status: int | None, code: str | None, retry_after: float | None) -> None:
        super().__init__(message, status=status, code=code)
        self.retry_after = retry_after
        self.retry_after_s = retry_after


class TokenRefused(Rejected):
    """401: the worker refused the gateway's token, so it read nothing of the call.

    A configuration error, the replica's side of it: it counts toward ejection, and it
    is neither a lost lease nor a cancel acknowledgement.
    """

    def __init__(self, message: str, *, status: int | None, code: str | None) -> None:
        super().__init__(message, status=status, code=code, retry_after=None)


# Fields of a worker start that the gateway sets, never the client: a refusal of one
# names no parameter of the client's.
WORKER_ONLY_FIELDS = frozenset({"request_id", "attempt", "lease_epoch", "lease_ttl_ms", "heartbeat_ms"})


class RequestRefused(WorkerError):
    kind = FailureKind.REQUEST_REFUSED
    released = True

    def __init__(self, message: str, *, status: int, code: str | None, field: str | None) -> None:
        # the worker names a field of its protocol; the client's parameters are under ``params``
        # or are the body's own (``messages[0].content``, ``prompt``, ``tools``): the client is
        # told of its parameter by the name it sent
        param = field.removeprefix("params.") if field and field not in WORKER_ONLY_FIELDS else None
        if field and param and param != field:
            message = message.replace(field, param)
        super().__init__(message, status=status, code=code)
        self.field = field
        self.param = param


class AttemptEnded(WorkerError):
    kind = FailureKind.REPLICA_EXITED
    released = True

    def __init__(self, message: str, *, code: str, status: int | None = None, generated_tokens: int | None = None):
        super().__init__(message, status=status, code=code)
        self.generated_tokens = generated_tokens


class LeaseLost(AttemptEnded):
    def __init__(self, message: str, *, code: str, status: int) -> None:
        super().__init__(message, code=code, status=status)
        self.released = code != "stale_lease_epoch"


def transport_error(exc: httpx.HTTPError) -> WorkerError:
    """The error of the tree that an httpx failure on a start, a stream or a health call is."""
    if isinstance(exc, httpx.ConnectTimeout):
        return ConnectTimedOut(f"no connection within the timeout: {exc!r}")
    if isinstance(exc, httpx.PoolTimeout):
        return Rejected(f"no free connection in the client's pool: {exc!r}", status=None, code=None, retry_after=None)
    if isinstance(exc, httpx.ConnectError):
        return ConnectFailed(f"cannot connect: {exc!r}")
    if isinstance(exc, httpx.TimeoutException):
        return ReadStalled(f"no data within the read timeout: {exc!r}")
    return StreamBroken(f"the connection broke: {exc!r}")


def error_fields(content: bytes) -> tuple[str | None, str, str | None]:
    """The code, message and field of a worker's error answer (``{"error": {...}}``);
    an answer that is not one gives its first characters as the message."""
    try:
        error = json.loads(content)["error"]
        return error.get("code"), error.get("message", ""), error.get("field")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, content.decode("utf-8", "replace")[:200], None
