"""What one delta's event costs to build, by wire format, side by side.

    python -m ops.bench.delta_events [--number 200000]

The event a streamed answer writes for each delta of plain text, the per-token path: a
chat completion chunk (``ChatShape.content_event``: pre-encoded bytes around the
text's JSON) and a Responses API ``response.output_text.delta`` (``ResponsesShape``:
a numbered event, one ``orjson.dumps`` of its fields, the text kept for the item's
``…done`` events). Prints microseconds an event.
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable

from app.api.chat.request import parse_request
from app.api.chat.shape import ChatShape, completion_id
from app.api.responses.request import parse_responses_request
from app.api.responses.shape import ResponsesShape
from app.config import Limits
from app.driver.request import CHAT

REQUEST_ID = "req_0123456789abcdef01234567"
TEXT = " quick"


def builders() -> dict[str, Callable[[], bytes]]:
    """Each wire format's delta event, built as a streamed answer builds it."""
    limits = Limits()
    chat = parse_request(CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, limits)
    chat_shape = ChatShape(chat, completion_id(chat, REQUEST_ID), 1796324087)
    responses = parse_responses_request({"model": "tiny", "input": "hi"}, limits)
    responses_shape = ResponsesShape(responses, REQUEST_ID, 1796324087)
    responses_shape.content_event(0, TEXT)  # the item's opening events go out with the first
    return {
        "chat completion chunk": lambda: chat_shape.content_event(1, TEXT),
        "response.output_text.delta": lambda: responses_shape.content_event(1, TEXT),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--number", type=int, default=200_000)
    n = parser.parse_args().number
    for name, build in builders().items():
        best = min(timeit.repeat(build, number=n, repeat=5)) / n
        print(f"{name:28} {best * 1e6:6.2f} µs an event")


if __name__ == "__main__":
    main()
