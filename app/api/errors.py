"""Client-facing errors: one tree, stable codes, the OpenAI error shape.

    ApiError                       an error a client gets as JSON {"error": {...}}
    ├── InvalidRequest       400   malformed JSON, wrong types, out-of-range values
    │   └── UnsupportedParameter   a parameter phasegate does not serve
    ├── Unauthorized         401   missing or wrong API key (or admin token)
    ├── Forbidden            403   the admin endpoints are disabled (no admin token set)
    ├── NotFound             404   unknown model, unknown request, unknown route
    ├── RequestTooLarge      413   body over the size limit
    └── ServiceUnavailable   503   the log is down, or the gateway is stopping

Failures decided by the policy (``upstream_decode_interrupted``, retries exhausted,
upstream refusals) are not raised: they come from ``FailRequest`` actions and are
rendered by :func:`policy_error_body` with the same shape plus the fields of
DESIGN.md §6.
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    status = 500
    type = "server_error"
    code = "internal_error"

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


class UnsupportedParameter(InvalidRequest):
    code = "unsupported_parameter"


class Unauthorized(ApiError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(ApiError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class NotFound(ApiError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class RequestTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class ServiceUnavailable(ApiError):
    status = 503
    type = "server_error"
    code = "service_unavailable"


def policy_error_body(
    request_id: str,
    *,
    code: str,
    message: str,
    partial_output: bool,
    delivered_output_tokens: int,
    retryable: bool,
    status: int,
) -> dict[str, Any]:
    """The error of a request the policy failed (DESIGN.md §6), in the OpenAI shape."""
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error" if 400 <= status < 500 else "server_error",
            "param": None,
            "code": code,
            "request_id": request_id,
            "partial_output": partial_output,
            "delivered_output_tokens": delivered_output_tokens,
            "retryable": retryable,
        }
    }
