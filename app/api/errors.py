"""Client-facing errors: one tree, stable codes, the OpenAI error shape.

    ApiError                       an error a client gets as JSON {"error": {...}}
    ├── InvalidRequest       400   malformed JSON, wrong types, out-of-range values
    │   └── UnsupportedParameter   a parameter phasegate does not serve
    ├── Unauthorized         401   missing or wrong API key (or admin token)
    ├── Forbidden            403   the admin endpoints are disabled (no admin token set)
    ├── NotFound             404   unknown model, unknown request, unknown route
    ├── RequestTooLarge      413   body over the size limit
    ├── UnsupportedMediaType 415   a POST body not declared as application/json
    ├── IdempotencyKeyReused 422   an Idempotency-Key sent again with another body
    ├── RateLimited          429   a tenant over one of its limits (app/api/limits.py), with Retry-After
    ├── ClientGone           499   the client left before its request was read whole (nobody reads it)
    └── ServiceUnavailable   503   the log is down, or the gateway is stopping
        └── LogUnavailable         the request log (or the fleet's store) cannot be read or written now

Each says whether the same request may succeed if sent again (``retryable``). Where it
cannot, the response carries ``x-should-retry: false`` (:func:`retry_headers`), which the
``openai`` SDK obeys: it otherwise retries 408, 409, 429 and every 5xx twice.

Failures of an accepted request (``upstream_decode_interrupted``, retries exhausted,
upstream refusals, the log lost) are not raised: the driver yields them as
:class:`~app.driver.outputs.Failed`, rendered by :func:`failure_body` with the same
shape plus the fields of docs/design.md §6.
"""

from __future__ import annotations

from typing import Any

from app.driver.outputs import Failed


class ApiError(Exception):
    status = 500
    type = "server_error"
    code = "internal_error"
    retryable = True  # may the same request succeed if sent again?

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self, request_id: str) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
                "request_id": request_id,
            }
        }


class InvalidRequest(ApiError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"
    retryable = False


class UnsupportedParameter(InvalidRequest):
    code = "unsupported_parameter"


class Unauthorized(ApiError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"
    retryable = False


class Forbidden(ApiError):
    status = 403
    type = "permission_error"
    code = "forbidden"
    retryable = False


class NotFound(ApiError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"
    retryable = False


class RequestTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"
    retryable = False


class UnsupportedMediaType(ApiError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"
    retryable = False


class IdempotencyKeyReused(ApiError):
    status = 422
    type = "invalid_request_error"
    code = "idempotency_key_reused"
    retryable = False


class RateLimited(ApiError):
    """The tenant is over one of its limits; ``retry_after_s`` goes out as ``Retry-After``."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"
    retryable = True

    def __init__(self, message: str, *, code: str, retry_after_s: int) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class ClientGone(ApiError):
    """The client closed its connection (or the server's body timeout closed it) while the
    body was being read: the answer goes nowhere, the refusal is only counted."""

    status = 499  # nginx's code for "the client went away"
    type = "invalid_request_error"
    code = "client_closed_request"
    retryable = False


class ServiceUnavailable(ApiError):
    status = 503
    type = "server_error"
    code = "service_unavailable"


class LogUnavailable(ServiceUnavailable):
    """The log is away: every route that reads or writes it refuses with this one error."""

    code = "event_log_unavailable"

    def __init__(self, what: str = "the request log") -> None:
        super().__init__(f"{what} is unavailable; retry shortly")


class BadGateway(ApiError):
    """A replica the gateway asked gave no usable answer."""

    status = 502
    type = "server_error"
    code = "upstream_unavailable"


def retry_headers(retryable: bool) -> dict[str, str]:
    """``x-should-retry: false`` when sending the same request again cannot help."""
    return {} if retryable else {"x-should-retry": "false"}


def failure_body(request_id: str, failed: Failed) -> dict[str, Any]:
    """The error of a request that failed after it was accepted (docs/design.md §6), in the OpenAI shape."""
    return {
        "error": {
            "message": failed.message,
            "type": "invalid_request_error" if 400 <= failed.http_status < 500 else "server_error",
            "param": failed.param,
            "code": failed.code,
            "request_id": request_id,
            "partial_output": failed.partial_output,
            "delivered_output_tokens": failed.delivered_output_tokens,
            "retryable": failed.retryable,
        }
    }
