"""A drain's errors say one thing: the message and the fields (docs/design.md §6, §11)."""

from __future__ import annotations

from typing import Any


def assert_refusal_says_one_thing(error: dict[str, Any]) -> None:
    """The 503 for a request that arrives during a drain: nothing accepted, send it again;
    true with one instance or many, so it promises no other instance."""
    assert error["code"] == "gateway_draining" and error.get("retryable", True) is True
    assert "send it again" in error["message"] and "takes it" not in error["message"]


def assert_ending_says_one_thing(error: dict[str, Any]) -> None:
    """The final error of a stream a drain ended: a message that agrees with ``retryable``."""
    assert error["code"] == "gateway_draining"
    message = error["message"]
    if error["partial_output"]:
        assert error["retryable"] is False and error["delivered_output_tokens"] > 0
        assert "will not run it again" in message and "retry" not in message and "send the request again" not in message
    else:
        assert error["retryable"] is True and "send the request again" in message
