"""An OpenAI-compatible upstream's streamed answer, read as frames.

How this works: the body comes as the bytes each socket read brought (``BodyReads``,
app/replicas/body_reads.py: the lean connections' ``Body``, or an ``httpx.Response``);
they are cut into SSE lines here (CR and LF only), each ``data:`` line parsed by orjson,
and each choice's text becomes a :class:`~app.replicas.base.Token`. The stream
completes once every choice finished and the usage came, without waiting for
``[DONE]``; what is malformed fails the attempt as docs/design.md §4 says (see
:mod:`app.replicas.openai_upstream`).

While the frames wait for the body's next read, a taker (``offer_tokens``: the request
loop's) may take plain tokens as their read arrives, in the connection's own callback
(``Body.tap``), so the loop's task is not woken for them: only a read of whole SSE events
that are each one choice's text and nothing else is offered (``_plain_token``), and what
the taker declines is read and yielded here as any read, in order. An upstream sends the
same bytes around the text of every plain token of a stream (vLLM: the same id, created,
model and fields), so once one such event was parsed, a later one with those bytes around
one JSON string is read as that string's token without parsing the chunk
(:class:`_Template`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import httpx
import orjson

from app.replicas.base import Frame, Token, UpstreamFailure
from app.replicas.body_reads import BodyReads, read_offering
from app.replicas.openai_chunks import (
    chunk_logprobs,
    chunk_token_ids,
    completion_text,
    delta_pieces,
    key_of_no_text,
    parse_chunk,
    prompt_of,
    tool_call_piece,
)
from app.replicas.stream_ending import ChunkUsage, StreamEnding, usage_said
from statemachine.deltas import CONTENT, NO_TEXT, TOOL_CALLS, Prompt
from statemachine.events import FailureKind

# After every choice finished, how long to wait for the usage chunk before completing
# without it: an upstream that never sends [DONE] must not hold the answer back.
USAGE_GRACE_S = 0.5


class OpenAIStream:
    unstreamed = False

    def __init__(self, body: BodyReads, choices: int, echo: str = "", *, continuous: bool = False) -> None:
        self._body = body
        self._choices = choices
        # asked for the usage in every chunk (``continuous_usage_stats``): each choice's first
        # token says the prompt's count, each token its chunk's tokens, and the end's usage
        # is the chunk of no choices that follows every choice's (``ChunkUsage``)
        self._continuous = continuous
        # a chat echo, sent here after each choice's role chunk as vLLM's stream sends it
        # (the upstream is not asked to: vLLM 0.32's streamed chat echo fails, app/replicas/chat_echo.py)
        self._echo, self._echo_due = echo, set(range(choices)) if echo else set()
        self._held_take: Callable[[list[Token]], bool] | None = None  # offered once the echo went out
        self._frames: AsyncGenerator[Frame, None] | None = None
        self._index = 0  # the next token's index
        self._take: Callable[[list[Token]], bool] | None = None  # takes tokens as they arrive (``offer_tokens``)
        self._template: _Template | None = None  # the bytes around a plain token's text, once learned
        self._learning = _LEARNING_TRIES  # events parsed in full that may still teach it

    def offer_tokens(self, take: Callable[[list[Token]], bool]) -> None:
        """Offer ``take`` the tokens of each read as it arrives, in the connection's own
        callback, while the frames wait for the body's next read; those it takes are not
        yielded. Only a read of whole SSE events, each carrying one choice's text and
        nothing else (no finish, usage, tool call, log probabilities or error), is
        offered: anything else, and tokens ``take`` declines, are read and yielded as
        before. Over the lean connections only (``Body.tap``); over httpx a no-op; not
        before the echo went out (it goes before any token)."""
        self._held_take = take if self._echo_due else None
        self._take = None if self._echo_due else take

    def frames(self) -> AsyncIterator[Frame]:
        """The stream's frames (once); :meth:`close` ends them."""
        assert self._frames is None, "one reader"
        self._frames = self._frames_of_the_body()
        return self._frames

    async def _frames_of_the_body(self) -> AsyncGenerator[Frame, None]:
        ending = StreamEnding()
        prompts: dict[int, Prompt] = {}  # what the replica said of a choice's prompt, until its first token
        counts = ChunkUsage() if self._continuous else None
        # Lines split here from the body's bytes, not by httpx's aiter_lines (three
        # generators a read, and str.splitlines, which also splits a JSON string at a raw
        # U+2028 or U+0085 that vLLM sends as it is): only CR and LF end an SSE line.
        body = self._body
        lines: list[bytes] = []  # complete lines not looked at yet, the next one last
        rest: bytes | None = b""  # a line whose end is not read yet; None once the body ended
        try:
            while True:
                finished = len(ending.finish_reasons) >= self._choices
                if finished and ending.usage is not None:
                    break  # everything is here: do not wait for [DONE]
                if not lines:
                    if rest is None:
                        break
                    try:
                        if finished:  # only the usage chunk may still come
                            async with asyncio.timeout(USAGE_GRACE_S):
                                read = await body.read()
                        else:  # tokens may be taken as they arrive, between whole lines
                            read = await read_offering(body, None if rest or self._take is None else self._tapped)
                    except TimeoutError:
                        break
                    if not read:  # the body ended; a last line without its line break
                        lines, rest = [rest.rstrip(b"\r")], None
                        continue
                    lines, rest = _split_lines(rest + read if rest else read)
                    continue
                line = lines.pop()
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments, event names
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = parse_chunk(data)
                tokens = 1 if chunk.get("usage") is None else usage_said(chunk, ending, counts)
                for choice in chunk.get("choices") or ():
                    number = choice.get("index", 0)
                    said = prompt_of(chunk, choice)
                    if said is not None:
                        prompts[number] = said
                    delta = choice.get("delta") or {}
                    pieces = delta_pieces(delta) if "delta" in choice else completion_text(choice)
                    calls = delta.get("tool_calls")
                    if calls:  # a piece of the choice's tool calls, passed on as vLLM streamed it
                        pieces.append((TOOL_CALLS, tool_call_piece(calls)))
                    logprobs = chunk_logprobs(choice.get("logprobs"))
                    ids = chunk_token_ids(choice.get("token_ids"))
                    if not pieces and logprobs:  # a token with no text of its own: its logprobs go on
                        pieces = [(key_of_no_text(delta) if "delta" in choice else CONTENT, "")]
                    elif not pieces and ids:  # its ids only (the client asked for them): a delta of no text
                        pieces = [(NO_TEXT, "")]
                    # the chunk's token, its logprobs and ids, and what was said of its prompt,
                    # go with the first piece (counted one token, as any chunk: an echo's ids
                    # name the prompt's tokens too)
                    for n, (key, text) in enumerate(pieces):
                        index, self._index = self._index, self._index + 1
                        if n:
                            yield Token(number, index, text, (), None, key, 0)
                        else:
                            counted = None if counts is None else counts.prompt(number)
                            yield Token(
                                number, index, text, ids, logprobs, key, tokens, prompts.pop(number, None), counted
                            )
                    if number in self._echo_due and delta.get("role"):
                        self._echo_due.discard(number)
                        index, self._index = self._index, self._index + 1
                        counted = None if counts is None else counts.prompt(number)
                        yield Token(number, index, self._echo, (), None, CONTENT, 0, prompts.pop(number, None), counted)
                        self._take = self._take if self._echo_due else self._held_take
                    ending.note(number, choice, calls)
        except httpx.TransportError as exc:
            raise UpstreamFailure(FailureKind.REPLICA_EXITED, f"stream broken: {exc!r}") from None
        if len(ending.finish_reasons) < self._choices:
            raise UpstreamFailure(FailureKind.REPLICA_EXITED, "the stream ended before every choice finished")
        for frame in ending.frames(None if counts is None else counts.last):
            yield frame

    def _tapped(self, received: bytes) -> bool:
        """A read offered by the body's tap: taken if it is plain tokens' events only
        (``_plain_token``), all of which ``take`` takes; otherwise nothing of it is used
        here (the frames read it, as any read)."""
        take = self._take
        events = received.split(b"\n\n")
        if take is None or events.pop() or b"\r" in received:  # not whole events, or CR line ends
            return False
        tokens: list[Token] = []
        template = self._template
        for event in events:
            index = self._index + len(tokens)
            token = None if template is None else template.token(event, index)
            if token is None:
                token = _plain_token(event, index)
                if token is None:
                    return False
                if template is None and self._learning:
                    self._learning -= 1
                    template = self._template = _Template.learned(event, token)
            tokens.append(token)
        if not tokens or not take(tokens):
            return False
        self._index += len(tokens)
        return True

    async def close(self) -> None:
        """Close the body, and the frames where no read of them is under way: an async
        generator left unfinished is closed by asyncio's finalizer hook, a wake-up of the
        loop from itself and a task each (one a request, the reader's last frame being
        ``Done``). One being read ends with the body."""
        if self._frames is not None:
            with contextlib.suppress(RuntimeError):  # read by another task just now
                await self._frames.aclose()
        await self._body.aclose()


# what a plain token's chunk and choice may hold (anything else non-null: not plain)
_PLAIN_CHUNK = frozenset({"id", "object", "created", "model", "choices", "system_fingerprint", "service_tier"})
_PLAIN_CHOICE = frozenset({"index", "delta", "text"})


def _plain_token(event: bytes, index: int) -> Token | None:
    """The token of an SSE event that is one ``data:`` line of one choice's text and
    nothing else (no finish, usage, tool call, log probabilities or error): the token
    the frames would yield for it, and all they would do. ``None`` for anything else."""
    if not event.startswith(b"data:") or b"\n" in event:
        return None
    try:
        chunk = orjson.loads(event[5:])
    except ValueError:
        return None
    choices = chunk.get("choices") if type(chunk) is dict else None
    if type(choices) is not list or len(choices) != 1 or "error" in chunk or chunk.get("usage") is not None:
        return None
    choice = choices[0]
    if type(choice) is not dict:
        return None
    for key in choice.keys() - _PLAIN_CHOICE:  # a finish, log probabilities, token ids, a field
        if choice[key] is not None:  # phasegate does not know: parsed in full
            return None
    for key in chunk.keys() - _PLAIN_CHUNK:
        if chunk[key] is not None:
            return None
    if "delta" in choice:
        delta = choice["delta"]
        if type(delta) is not dict or any(value is not None for key, value in delta.items() if key != CONTENT):
            return None  # reasoning, tool calls, a role: the frames read it in full
        text = delta.get(CONTENT)
    else:
        text = choice.get("text")
    number = choice.get("index", 0)
    if type(text) is not str or not text or type(number) is not int:
        return None
    return Token(number, index, text, (), None)


_LEARNING_TRIES = 3  # an upstream whose plain events teach no template is parsed in full


class _Template:
    """The bytes before and after the text of an upstream's plain-token SSE event (one
    ``data:`` line of one choice's text and nothing else: ``_plain_token``). An event
    that is those bytes around one JSON string is the same chunk with that text: its
    token, read without parsing the chunk. Learned only where it holds (``learned``)."""

    __slots__ = ("after", "before", "choice")

    def __init__(self, before: bytes, after: bytes, choice: int) -> None:
        self.before, self.after, self.choice = before, after, choice

    @classmethod
    def learned(cls, event: bytes, token: Token) -> _Template | None:
        """The template of ``event``, a plain token's (``token``): where the text's JSON, as
        orjson writes it, follows the one ``"content":`` (chat) or ``"text":``. ``None``
        where that is not found once, or where another text put there would not be read as
        that text's token by ``_plain_token`` (so no template ever reads what it would not)."""
        text = orjson.dumps(token.text)
        for key in (b'"content":', b'"text":'):
            if event.count(key + text) == 1:
                split = event.index(key + text) + len(key)
                template = cls(event[:split], event[split + len(text) :], token.choice)
                probe = _plain_token(template.before + b'"\\u0001"' + template.after, 0)
                if probe is not None and probe.text == "\x01" and probe.choice == token.choice:
                    return template
        return None

    def token(self, event: bytes, index: int) -> Token | None:
        """The token of ``event`` if it is this template around one non-empty JSON string."""
        before, after = self.before, self.after
        if not event.startswith(before) or not event.endswith(after):
            return None
        try:  # (an event shorter than both leaves nothing between them, which orjson refuses)
            text = orjson.loads(event[len(before) : len(event) - len(after)])
        except ValueError:
            return None
        if type(text) is not str or not text:
            return None
        return Token(self.choice, index, text, (), None)


def _split_lines(received: bytes) -> tuple[list[bytes], bytes]:
    """The complete lines of ``received`` (CRLF, LF or CR ended), the next one last, and
    the start of the line after them. A trailing CR is held back: it may be half a CRLF."""
    held = b""
    if received.endswith(b"\r"):
        received, held = received[:-1], b"\r"
    if b"\r" in received:
        received = received.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    *lines, rest = received.split(b"\n")
    lines.reverse()
    return lines, rest + held
