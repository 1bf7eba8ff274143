"""``ops/bench/delta_events.py`` builds each wire format's delta event as a streamed answer
does: the bytes it times are the events a client parses."""

from __future__ import annotations

import json

from ops.bench.delta_events import TEXT, builders


def test_each_format_builds_the_event_its_client_reads() -> None:
    built = {name: build() for name, build in builders().items()}
    chat = built["chat completion chunk"].decode()
    assert chat.startswith("id: 1\ndata: ")
    assert json.loads(chat.split("data: ", 1)[1])["choices"][0]["delta"] == {"content": TEXT}
    event, data = built["response.output_text.delta"].decode().split("\n", 1)
    assert event == "event: response.output_text.delta"
    delta = json.loads(data.removeprefix("data: "))
    assert (delta["type"], delta["delta"], delta["output_index"]) == ("response.output_text.delta", TEXT, 0)
