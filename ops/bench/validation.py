"""What validating a request body costs, per request, from one or more source trees side by side.

    git archive <commit> | tar -x -C /tmp/before
    python -m ops.bench.validation before=/tmp/before after=.     # alternating rounds
    python -m ops.bench.validation . --number 20000

Each tree's ``app.api.chat.request.parse_request`` is timed in a process of its own (the tree
first on its ``sys.path``), on the bodies below, already decoded from JSON as the route
gives them: a minimal chat request, an agent's turn (a system prompt, a tool call and its
result, two tools, sampling fields and vLLM extras), a structured-output request and a
completions request, and a Responses API request (an agent's turn again; it is checked,
then made the chat request it asks for, which is checked too). The trees run in turn,
``--rounds`` times, so that each sees the machine as it was; the best of each tree's
rounds is printed, in microseconds a request.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import timeit
from pathlib import Path
from typing import Any

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather where the user is",
        "parameters": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}}},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat, minimal": ("chat", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
    "chat, an agent's turn": (
        "chat",
        {
            "model": "tiny",
            "messages": [
                {"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": [{"type": "text", "text": "What is the weather?"}]},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "user", "content": "and tomorrow?"},
            ],
            "tools": [WEATHER, CLOCK],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "temperature": 0.7,
            "top_p": 0.9,
            "max_tokens": 256,
            "stream": True,
            "stream_options": {"include_usage": True},
            "top_k": 40,
            "logprobs": True,
            "top_logprobs": 2,
            "metadata": {"team": "search"},
        },
    ),
    "chat, structured output": (
        "chat",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "a colour"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {"type": "object"}}},
        },
    ),
    "completions": ("completions", {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 16, "stop": ["\n"]}),
    "responses, an agent's turn": (
        "responses",
        {
            "model": "tiny",
            "instructions": "You answer briefly.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "What is the weather?"}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                {"role": "user", "content": "and tomorrow?"},
            ],
            "tools": [{"type": "function", **WEATHER["function"]}],
            "temperature": 0.7,
            "max_output_tokens": 256,
            "stream": True,
        },
    ),
}


def measure(number: int) -> dict[str, float]:
    """Microseconds a request for each body, in this process's tree (the best of five)."""
    from app.api.chat.request import parse_request
    from app.api.responses.request import parse_responses_request
    from app.config import Limits
    from app.driver.request import CHAT, COMPLETIONS

    limits = Limits()
    endpoints = {"chat": CHAT, "completions": COMPLETIONS, "responses": "responses"}
    figures = {}
    for name, (endpoint, body) in BODIES.items():

        def parse(endpoint: str = endpoints[endpoint], body: dict[str, Any] = body) -> None:
            if endpoint == "responses":
                parse_responses_request(body, limits)
            else:
                parse_request(endpoint, body, limits)

        parse()  # it is valid in every tree compared

        figures[name] = min(timeit.repeat(parse, number=number, repeat=5)) / number * 1e6
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="+", help="NAME=DIR, or DIR (named by itself)")
    parser.add_argument("--number", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: measure this process's tree
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.number)))
        return
    trees = dict(tree.split("=", 1) if "=" in tree else (tree, tree) for tree in args.trees)
    best: dict[str, dict[str, float]] = {name: {} for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            root = Path(tree).resolve()
            code = (
                f"import sys; sys.path.insert(0, {str(root)!r}); sys.argv = {sys.argv[:1]!r}"
                f" + ['--one', '1', '--number', '{args.number}', '.']; import runpy;"
                f" runpy.run_path({str(root / 'ops/bench/validation.py')!r}, run_name='__main__')"
            )
            if not (root / "ops/bench/validation.py").exists():  # a tree from before this bench
                code = code.replace(str(root / "ops/bench/validation.py"), __file__)
            out = subprocess.run([sys.executable, "-c", code], cwd=root, check=True, capture_output=True, text=True)
            for body, micros in json.loads(out.stdout).items():
                best[name][body] = min(micros, best[name].get(body, micros))
    print(f"{'µs a request (best of rounds)':32}" + "".join(f"{name:>14}" for name in trees))
    for body in BODIES:
        print(f"{body:32}" + "".join(f"{best[name][body]:14.1f}" for name in trees))


if __name__ == "__main__":
    main()
