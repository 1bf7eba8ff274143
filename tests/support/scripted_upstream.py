"""A scripted OpenAI-compatible server: the upstream HTTP behaviours a gateway must handle.

vLLM's own server cannot be told to misbehave, so the gateway's handling of 429s,
4xx refusals, 5xx, malformed chunks, streams without ``[DONE]`` and upstreams that
never answer is tested against this small server, run as its own process on a real
socket. It streams deterministic text for any prompt; ``POST /admin/script`` queues
behaviours that the next requests consume one each (``"attempt": n`` keeps one for
the gateway's n-th attempt of a request, read from the ``x-request-id`` it sends); ``GET /admin/requests`` counts
the generation requests it received, the streams whose client closed the connection before
the end (``aborted``, by ``x-request-id``: what vLLM aborts) and shows the last one's body.
Run: ``python -m tests.support.scripted_upstream --fd N`` (a listening socket it inherits).

Behaviours (JSON): ``{"status": 429, "retry_after": 3}``, ``{"status": 400, "code":
"context_length_exceeded", "message": "…", "param": "messages"}``, ``{"malformed_at": k}`` (with ``"malformed":
"lone_surrogate"``: valid JSON whose text is a lone UTF-16 surrogate),
``{"no_done": "hold"}`` (open, silent), ``{"no_done": "close"}``, ``{"cut_at": k}``, ``{"hang": true}``,
``{"die_at": k, "point": "prefill" | "before_frame" | "after_frame"}`` (the process exits),
``{"delay_first_s": x}``, ``{"error_in_stream": {"message": "…", "code": 400}}`` (after the
role chunk, an error object in the stream, as vLLM streams its engine's refusal),
``{"tool": name, "arguments": "{…}"}`` (with ``"pieces": n``:
streamed as vLLM streams a call, its name, then its arguments in n parts), ``{"tool_call_then_die": true}``,
``{"reasoning": k}`` (chat: the first k words are reasoning, as vLLM's reasoning parser
streams them, then the think block's end, a token with no text: ``delta: {}``, with its
log probabilities when asked for, as vLLM sends it; then content),
``{"nul_at": k}`` (U+0000 after the k-th word), ``{"finish_reason": "…"}`` (the word it
ends with), ``{"burst": n}`` (the tokens' chunks written n at a time, so that a gateway
reads several at once). A request asking for ``logprobs`` gets -0.5 for each word and one alternative (with
``return_tokens_as_token_ids``, named by their ids, as vLLM names them).
One asking for ``return_token_ids`` gets each word's id (:func:`token_id`) in its chunk, the
prompt's (:func:`prompt_token_ids`) where vLLM puts them (a chat stream's role chunk, a
completion choice's first chunk) and, with a ``stop`` finish, the end-of-sequence id
(:data:`EOS`) in a chunk of no text, as vLLM sends it; ``return_prompt_text`` gets the prompt
as its rendered text (chat: in the role chunk).
One asking for ``stream_options.continuous_usage_stats`` gets the usage so far in each chunk,
as vLLM sends it: the prompt's 3 tokens, a word two tokens (so a chunk is not a token), the
finish chunk's end-of-sequence token one more, and the usage chunk at the end with
``prompt_tokens_details`` beside the counts.
One asking ``stream: false`` gets the answer whole, as vLLM's server writes it (one choice),
with ``prompt_logprobs`` where asked (a function of the prompt's words: :func:`prompt_logprobs`)
and an echo's text first, as vLLM's whole echo has it (chat: a continued last message's content);
``die_at`` (any point) exits before it is written.
A pooling request (``/v1/embeddings``, ``/score`` …) gets the sim engine's answer.
A request with tools gets a tool call. ``POST /tools/execute`` is a tool webhook counting
runs per ``Idempotency-Key`` (``GET /admin/tools``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.contract.pooling import ROUTES as POOLING_ROUTES
from app.worker import sim_pooling
from ops.processes import listening_socket

POOLING_PATHS = tuple(POOLING_ROUTES)

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


EOS = 2


ALTERNATIVE_ID, THINK_END_ID = 98, 99  # the ids of the one alternative ("~") and of the think block's end


def token_id(word: str) -> int:
    """A word's token id, as a request asking for ``return_token_ids`` gets it."""
    return 100 + WORDS.index(word.strip())


def prompt_token_ids(prompt: str) -> list[int]:
    return [len(word) for word in prompt.split()]


def answer(prompt: str, max_tokens: int) -> list[str]:
    """The deterministic answer to ``prompt``: the same on every upstream of this kind."""
    seed = sum(prompt.encode())
    return [WORDS[(seed + i * 7) % len(WORDS)] + " " for i in range(max_tokens)]


class Upstream:
    def __init__(self, token_delay_s: float) -> None:
        self.script: deque[dict[str, Any]] = deque()
        self.requests = 0
        self.last_body: dict[str, Any] | None = None  # the last generation request, as received
        self.token_delay_s = token_delay_s
        self.tool_runs: dict[str, int] = {}
        self.aborted: list[str] = []  # x-request-id of each stream whose client closed it early

    async def admin_script(self, request: Request) -> Response:
        behaviours = await request.json()
        if not behaviours:
            self.script.clear()
        self.script.extend(behaviours)
        return JSONResponse({"queued": len(self.script)})

    async def admin_requests(self, request: Request) -> Response:
        return JSONResponse({"requests": self.requests, "last_body": self.last_body, "aborted": self.aborted})

    async def generate(self, request: Request) -> Response:
        body = orjson.loads(await request.body())  # as deep as orjson reads (the gateway's limit is under it)
        chat = request.url.path.endswith("/chat/completions")
        if body.get("max_tokens") == 1 and body.get("prompt") == "ping":
            return JSONResponse({"choices": [{"text": "pong", "finish_reason": "length"}]})  # health probe
        self.requests += 1
        self.last_body = body
        attempt = int(request.headers.get("x-request-id", "x.0").rsplit(".", 1)[-1] or 0)
        behaviour = self._take(attempt)
        if behaviour.get("hang"):
            await asyncio.sleep(3600)
        status = behaviour.get("status")
        if status:
            error = {
                "message": behaviour.get("message", f"scripted {status}"),
                "type": "error",
                "code": behaviour.get("code"),
                "param": behaviour.get("param"),
            }
            headers = {"retry-after": str(behaviour["retry_after"])} if "retry_after" in behaviour else None
            return JSONResponse({"error": error}, status_code=status, headers=headers)
        prompt = "\n".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
        words = answer(prompt, int(body.get("max_tokens") or 16))
        if chat and body.get("tools"):
            behaviour = {**behaviour, "tool": body["tools"][0]["function"]["name"]}
        if body.get("logprobs") is not None:  # as vLLM: -0.5 for each word, -1.5 for one alternative
            behaviour = {**behaviour, "logprobs": "as ids" if body.get("return_tokens_as_token_ids") else True}
        if body.get("return_token_ids"):
            behaviour = {**behaviour, "prompt_token_ids": prompt_token_ids(prompt)}
        if body.get("return_prompt_text"):
            behaviour = {**behaviour, "prompt_text": f"<|user|>{prompt}<|assistant|>"}
        if (body.get("stream_options") or {}).get("continuous_usage_stats"):
            behaviour = {**behaviour, "continuous": True}
        if body.get("stream") is False:
            if behaviour.get("die_at") is not None:
                os._exit(1)  # the answer "computed", never sent
            return JSONResponse(_whole(chat, body, prompt, words, behaviour))
        chunks = self._chunks(chat, body["model"], words, behaviour)
        return StreamingResponse(
            self._noting_abort(chunks, request.headers.get("x-request-id", "")), media_type="text/event-stream"
        )

    async def _noting_abort(self, chunks: AsyncIterator[bytes], request_id: str) -> AsyncIterator[bytes]:
        """``chunks``, noting when the client closed the connection before they ended (the
        response is cancelled then, as vLLM's server aborts the request)."""
        try:
            async for chunk in chunks:
                yield chunk
        except asyncio.CancelledError:
            self.aborted.append(request_id)
            raise

    async def pool(self, request: Request) -> Response:
        """A pooling request (vLLM's routes): the sim engine's answer (app/worker/sim_pooling.py);
        its behaviours: ``status``, ``hang``, ``delay_first_s``, ``die_at`` (the process exits
        before it answers)."""
        body = orjson.loads(await request.body())
        self.requests += 1
        self.last_body = body
        request_name = request.headers.get("x-request-id", "x.0")
        behaviour = self._take(int(request_name.rsplit(".", 1)[-1] or 0))
        if behaviour.get("hang"):
            await asyncio.sleep(3600)
        await asyncio.sleep(float(behaviour.get("delay_first_s", 0)))
        if behaviour.get("die_at") is not None:
            os._exit(1)
        status = behaviour.get("status")
        if status:
            error = {"message": behaviour.get("message", f"scripted {status}"), "type": "BadRequestError"}
            error |= {"code": status, "param": behaviour.get("param")}
            return JSONResponse({"error": error}, status_code=status)
        try:
            answer, headers = sim_pooling.answer(request.url.path, body, body["model"], request_name, int(time.time()))
        except sim_pooling.PoolingRefused as refused:
            error = {"message": str(refused), "type": "BadRequestError", "param": refused.param, "code": 400}
            return JSONResponse({"error": error}, status_code=400)
        if isinstance(answer, bytes):
            return Response(answer, media_type="application/octet-stream", headers=headers)
        return JSONResponse(answer, headers=headers)

    def _take(self, attempt: int) -> dict[str, Any]:
        """The first queued behaviour for this attempt number (or for any attempt)."""
        for behaviour in self.script:
            if behaviour.get("attempt") in (None, attempt):
                self.script.remove(behaviour)
                return behaviour
        return {}

    async def execute_tool(self, request: Request) -> Response:
        """A tool webhook: counts executions per idempotency key."""
        key = request.headers.get("idempotency-key", "")
        self.tool_runs[key] = self.tool_runs.get(key, 0) + 1
        return JSONResponse({"ok": True})

    async def admin_tools(self, request: Request) -> Response:
        return JSONResponse({"runs": self.tool_runs})

    async def _chunks(
        self, chat: bool, model: str, words: list[str], behaviour: dict[str, Any]
    ) -> AsyncIterator[bytes]:
        head = {
            "id": "cmpl-scripted",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        if behaviour.get("delay_first_s"):
            await asyncio.sleep(behaviour["delay_first_s"])  # a long queue or prefill, in silence
        said = {key: behaviour[key] for key in ("prompt_token_ids", "prompt_text") if key in behaviour}
        so_far = _usage_so_far if behaviour.get("continuous") else lambda completed: {}
        if chat:
            yield _sse(
                {
                    **head,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                    **so_far(0),
                    **said,
                }
            )
        if behaviour.get("die_at") is not None and behaviour.get("point") == "prefill":
            os._exit(1)
        if behaviour.get("error_in_stream"):  # as vLLM streams its engine's refusal once the stream began
            yield _sse({"error": behaviour["error_in_stream"]})
            yield b"data: [DONE]\n\n"
            return
        if behaviour.get("tool"):
            async for chunk in self._tool_call(head, behaviour):
                yield chunk
            return
        burst, written = int(behaviour.get("burst", 1)), []
        for index, word in enumerate(words):
            if behaviour.get("die_at") == index and behaviour.get("point", "before_frame") == "before_frame":
                os._exit(1)  # the token was "computed", its chunk never sent
            if behaviour.get("malformed_at") == index:
                if behaviour.get("malformed") == "lone_surrogate":  # JSON, but not Unicode text
                    choice = {"index": 0, "delta": {"content": "\ud800"}} if chat else {"index": 0, "text": "\ud800"}
                    yield _sse({**head, "choices": [{**choice, "finish_reason": None}]})
                else:
                    yield b"data: {this is not json\n\n"
            if behaviour.get("cut_at") == index:
                raise ConnectionResetError("scripted cut")  # uvicorn drops the connection mid-body
            await asyncio.sleep(self.token_delay_s)
            if behaviour.get("nul_at") == index:
                word = f"{word}\x00"  # U+0000: valid text that PostgreSQL cannot hold
            field = "reasoning" if index < behaviour.get("reasoning", 0) else "content"
            choice = {"index": 0, "delta": {field: word}} if chat else {"index": 0, "text": word}
            if behaviour.get("logprobs"):
                choice["logprobs"] = _logprobs(word, chat, behaviour["logprobs"] == "as ids")
            if "prompt_token_ids" in behaviour:
                choice["token_ids"] = [token_id(word)]
                if not chat and index == 0:
                    choice["prompt_token_ids"] = behaviour["prompt_token_ids"]
            if chat and index == behaviour.get("reasoning", 0) > 0 and behaviour.get("logprobs"):
                think_end = {
                    "index": 0,
                    "delta": {},
                    "logprobs": _logprobs("</think>", chat, behaviour["logprobs"] == "as ids"),
                }
                written.append(_sse({**head, "choices": [{**think_end, "finish_reason": None}]}))
            written.append(_sse({**head, "choices": [{**choice, "finish_reason": None}], **so_far(2 * index + 2)}))
            if len(written) < burst and index < len(words) - 1:
                continue
            yield b"".join(written)
            written.clear()
            if behaviour.get("die_at") == index and behaviour.get("point") == "after_frame":
                await asyncio.sleep(0.05)  # let the chunk leave, then die
                os._exit(1)
        last: dict[str, Any] = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
        if "prompt_token_ids" in behaviour and behaviour.get("finish_reason") == "stop":
            last["token_ids"] = [EOS]  # the end-of-sequence token: ids, no text
        finish = {**head, "choices": [{**last, "finish_reason": behaviour.get("finish_reason", "length")}]}
        yield _sse({**finish, **so_far(2 * len(words) + 1)})
        usage = {"prompt_tokens": 3, "completion_tokens": len(words), "total_tokens": 3 + len(words)}
        if behaviour.get("continuous"):  # a word two tokens, the end of sequence one more; details at the end
            usage = {**so_far(2 * len(words) + 1)["usage"], "prompt_tokens_details": {"cached_tokens": 0}}
        yield _sse({**head, "choices": [], "usage": usage})
        if behaviour.get("no_done") == "hold":
            await asyncio.sleep(3600)  # never says [DONE]; the connection stays open
        if not behaviour.get("no_done"):
            yield b"data: [DONE]\n\n"

    async def _tool_call(self, head: dict[str, Any], behaviour: dict[str, Any]) -> AsyncIterator[bytes]:
        arguments = behaviour.get("arguments", "{}")
        for piece in _call_pieces(behaviour["tool"], arguments, int(behaviour.get("pieces", 0))):
            yield _sse({**head, "choices": [{"index": 0, "delta": {"tool_calls": [piece]}, "finish_reason": None}]})
        if behaviour.get("tool_call_then_die"):
            await asyncio.sleep(0.05)
            os._exit(1)
        yield _sse({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
        yield _sse({**head, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}})
        yield b"data: [DONE]\n\n"


def _usage_so_far(completed: int) -> dict[str, Any]:
    """A chunk's usage so far (``continuous_usage_stats``), as vLLM's server writes it."""
    return {"usage": {"prompt_tokens": 3, "total_tokens": 3 + completed, "completion_tokens": completed}}


def _call_pieces(name: str, arguments: str, pieces: int) -> list[dict[str, Any]]:
    """A tool call's deltas: whole in one (``pieces`` 0), or as vLLM's tool parsers stream
    it, its id and name first, then its arguments in ``pieces`` parts."""
    call = {"index": 0, "id": "call_upstream", "type": "function"}
    if not pieces:
        return [{**call, "function": {"name": name, "arguments": arguments}}]
    size = -(-len(arguments) // pieces)
    parts = [arguments[n : n + size] for n in range(0, len(arguments), size)]
    return [{**call, "function": {"name": name}}] + [{"index": 0, "function": {"arguments": p}} for p in parts]


def _logprobs(word: str, chat: bool, as_ids: bool = False) -> dict[str, Any]:
    """As vLLM: with ``return_tokens_as_token_ids`` each token named ``token_id:<id>``, a chat
    token's ``bytes`` its text's all the same (an alternative's, its name's)."""
    named = token_id(word) if word.strip() in WORDS else THINK_END_ID
    name, other = (f"token_id:{named}", f"token_id:{ALTERNATIVE_ID}") if as_ids else (word, "~")
    if chat:
        top = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in ((name, -0.5), (other, -1.5))]
        return {"content": [{"token": name, "logprob": -0.5, "bytes": list(word.encode()), "top_logprobs": top}]}
    return {"tokens": [name], "token_logprobs": [-0.5], "top_logprobs": [{name: -0.5, other: -1.5}], "text_offset": [0]}


def prompt_logprobs(prompt: str, top: int) -> list[dict[str, dict[str, Any]] | None]:
    """A prompt's log probabilities as vLLM's whole answer gives them: none for its first word;
    at each other, the word (its id, -1.0, rank 2) and ``top`` alternatives (``~``: -0.25, rank 1)."""
    said: list[dict[str, dict[str, Any]] | None] = [None]
    for word in prompt.split()[1:]:
        place = {str(len(word)): {"logprob": -1.0, "rank": 2, "decoded_token": word}}  # (prompt_token_ids)
        if top:
            place[str(ALTERNATIVE_ID)] = {"logprob": -0.25, "rank": 1, "decoded_token": "~"}
        said.append(place)
    return said


def _whole(
    chat: bool, body: dict[str, Any], prompt: str, words: list[str], behaviour: dict[str, Any]
) -> dict[str, Any]:
    """The whole answer vLLM's server writes for an unstreamed request (one choice)."""
    text = "".join(words)
    if body.get("echo") and not chat:
        text = prompt + text
    elif (
        body.get("echo") and body.get("add_generation_prompt") is False and body["messages"][-1]["role"] == "assistant"
    ):
        text = body["messages"][-1]["content"] + text  # a continued message, echoed
    asked = body.get("prompt_logprobs")
    if asked is None and body.get("echo"):  # as vLLM's request models read an echo
        asked = (body.get("top_logprobs") or 0) if chat else body.get("logprobs")
    said = None if asked is None else prompt_logprobs(prompt, asked)
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": behaviour.get("finish_reason", "length")}
    if behaviour.get("logprobs"):
        entries = [_logprobs(word, chat) for word in words]
        if chat:
            choice["logprobs"] = {"content": [e for entry in entries for e in entry["content"]]}
        else:
            columns = ("tokens", "token_logprobs", "top_logprobs")
            choice["logprobs"] = {k: [v for entry in entries for v in entry[k]] for k in columns}
            choice["logprobs"]["text_offset"] = [len("".join(words[:i])) for i in range(len(words))]
    usage = {"prompt_tokens": 3, "completion_tokens": len(words), "total_tokens": 3 + len(words)}
    answer: dict[str, Any] = {"id": "cmpl-scripted", "created": int(time.time()), "model": body["model"]}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
        return answer | {"object": "chat.completion", "choices": [choice], "usage": usage, "prompt_logprobs": said}
    choice |= {"text": text, "prompt_logprobs": said}
    return answer | {"object": "text_completion", "choices": [choice], "usage": usage}


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


@contextlib.contextmanager
def running_scripted_upstream(token_delay_s: float = 0.002) -> Iterator[ScriptedUpstream]:
    """The server in its own process on a socket bound to a free port; killed (with its group) on exit."""
    with listening_socket() as listener:  # the child takes it as it is: no port freed for it to bind
        command = [sys.executable, "-m", "tests.support.scripted_upstream", "--fd", str(listener.fileno())]
        command += ["--token-delay-s", str(token_delay_s)]
        process = subprocess.Popen(
            command,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=[listener.fileno()],
        )
        upstream = ScriptedUpstream(f"http://127.0.0.1:{listener.getsockname()[1]}", process)
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(upstream.base_url + "/admin/requests").status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the scripted upstream did not start")
            time.sleep(0.05)
        yield upstream
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


@dataclass
class ScriptedUpstream:
    base_url: str
    process: subprocess.Popen[bytes]

    def script(self, *behaviours: dict[str, Any]) -> None:
        httpx.post(self.base_url + "/admin/script", json=list(behaviours)).raise_for_status()

    @property
    def requests(self) -> int:
        return int(httpx.get(self.base_url + "/admin/requests").json()["requests"])

    @property
    def last_body(self) -> dict[str, Any] | None:
        """The body of the last generation request it received."""
        body: dict[str, Any] | None = httpx.get(self.base_url + "/admin/requests").json()["last_body"]
        return body

    @property
    def aborted(self) -> list[str]:
        """The ``x-request-id`` of each stream whose client closed the connection early."""
        return list(httpx.get(self.base_url + "/admin/requests").json()["aborted"])

    @property
    def tool_runs(self) -> dict[str, int]:
        return dict(httpx.get(self.base_url + "/admin/tools").json()["runs"])

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


def build(token_delay_s: float = 0.002) -> Starlette:
    upstream = Upstream(token_delay_s)
    return Starlette(
        routes=[
            Route("/v1/chat/completions", upstream.generate, methods=["POST"]),
            Route("/v1/completions", upstream.generate, methods=["POST"]),
            *(Route(path, upstream.pool, methods=["POST"]) for path in POOLING_PATHS),
            Route("/admin/script", upstream.admin_script, methods=["POST"]),
            Route("/admin/requests", upstream.admin_requests, methods=["GET"]),
            Route("/admin/tools", upstream.admin_tools, methods=["GET"]),
            Route("/tools/execute", upstream.execute_tool, methods=["POST"]),
        ]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True, help="a listening socket, inherited")
    parser.add_argument("--token-delay-s", type=float, default=0.002)
    options = parser.parse_args()
    uvicorn.run(build(options.token_delay_s), fd=options.fd, log_level="warning")
