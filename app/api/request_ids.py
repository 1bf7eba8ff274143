"""Request ids: the gateway's own, and those that come from a client, in a path: checked
before the log is asked for them, and echoed in ``x-request-id`` only where a header can
carry them."""

from __future__ import annotations

import uuid

from app.api.errors import InvalidRequest

MAX_REQUEST_ID_CHARS = 256


def new_request_id() -> str:
    """The id of a request, or of an HTTP exchange that every answer names."""
    return f"req_{uuid.uuid4().hex[:24]}"


def check_request_id(request_id: str) -> None:
    """A request id the log could hold: printable, no NUL (PostgreSQL text refuses it), not huge."""
    if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise InvalidRequest(
            f"a request id is printable text of at most {MAX_REQUEST_ID_CHARS} characters",
            param="request_id",
            code="invalid_request_id",
        )


def id_header(request_id: str) -> dict[str, str]:
    """``x-request-id`` naming ``request_id`` if a header can hold it: printable ASCII, no space
    at either end (the gateway's own ids always are; a client's ``é`` made the answer a 500, and
    `` a`` a closed connection, as the server refused the header after the response had begun)."""
    fits = request_id.isascii() and request_id.isprintable() and request_id.strip() == request_id
    return {"x-request-id": request_id} if fits else {}
