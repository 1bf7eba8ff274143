"""One line of words per event and per decision, for the replay table and the timeline page."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from statemachine import events as ev
from statemachine.actions import ACTION_TYPES, action_params_order
from statemachine.events import Event

TEXT_PREVIEW = 24  # characters of delivered text shown in a description


def describe_event(event: Event, *, background: bool = False) -> str:
    """The event's type and the fields a responder reads first, e.g.
    ``UpstreamFailed replica_exited: connection reset``; ``background``: the request is a
    background response (its ``RequestAccepted`` says), whose readers come and go with no grace."""
    name = type(event).__name__
    if background and isinstance(event, ev.ClientDisconnected):
        return f"{name} a reader left; a background response generates on with no client (no grace applies)"
    detail = _detail(event)
    return f"{name} {detail}" if detail else name


def describe_decision(decision: Mapping[str, Any]) -> str:
    """A recorded or recomputed decision as ``action(reason) k=v …`` (empty parameters left out),
    its parameters in the action's own order whatever order the log kept them in."""
    values = decision.get("params", {})
    action = ACTION_TYPES.get(decision["action"])
    order = action_params_order(action) if action is not None else ()
    names = [name for name in order if name in values] + sorted(set(values) - set(order))
    params = " ".join(
        f"{name}={_pool(values[name]) if name == 'pool' else _short(values[name])}"
        for name in names
        if values[name] not in (None, [], "")
    )
    head = f"{decision['action']}({decision['reason']})"
    return f"{head} {params}" if params else head


def preview(text: str | None) -> str:
    """Delivered text, quoted and cut to :data:`TEXT_PREVIEW` characters (``None``: not kept)."""
    if text is None:
        return "(text not kept)"
    cut = text if len(text) <= TEXT_PREVIEW else text[: TEXT_PREVIEW - 1] + "…"
    return repr(cut)


def plural(count: int, noun: str) -> str:
    """``1 request``, ``2 requests``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _detail(event: Event) -> str:
    if isinstance(event, ev.RequestAccepted):
        return f"model={event.model} prompt_tokens={event.prompt_tokens} n={event.n} max_attempts={event.max_attempts}"
    if isinstance(event, ev.AttemptStarted):
        return f"on {event.replica_id} lease_epoch={event.lease_epoch} lease until {_clock(event.lease_expires_at)}"
    if isinstance(event, ev.FirstDeltaCommitted):
        return "commit point: no retry from here"
    if isinstance(event, ev.DeltasDelivered | ev.DeltasProduced):
        digest = event.text_sha256
        shown = f"sha256:{digest[:12]}…" if event.text is None and digest else preview(event.text)
        unattended = " (no client attached)" if isinstance(event, ev.DeltasProduced) else ""
        return f"deltas [{event.from_index}, {event.to_index}) {event.tokens} tokens{unattended} {shown}"
    if isinstance(event, ev.ClientDisconnected) and event.resume_grace_s:
        return f"generation goes on for {event.resume_grace_s:g}s for a client to come back"
    if isinstance(event, ev.ClientResumed):
        return f"a client came back with deltas up to {event.after}, at {event.gateway}"
    if isinstance(event, ev.ToolCallEmitted):
        return f"{event.name} {event.tool_call_id}"
    if isinstance(event, ev.StreamResumed):
        return f"deltas [{event.from_index}, {event.to_index}) sent again from the log by {event.gateway}"
    if isinstance(event, ev.UpstreamFailed):
        kind = f"{event.kind.value} ({event.deadline.value} deadline)" if event.deadline else event.kind.value
        status = f" HTTP {event.upstream_status}" if event.upstream_status is not None else ""
        return f"{kind}{status}: {event.detail}"
    if isinstance(event, ev.CancelAcked) and event.generated_tokens is not None:
        return f"after {event.generated_tokens} generated tokens"
    if isinstance(event, ev.AttemptFenced):
        return f"waiting for {event.waiting_for}"
    if isinstance(event, ev.AttemptReleased):
        return f"because {event.because.value}"
    if isinstance(event, ev.Decided):
        return f"{event.action}({event.reason})"
    if isinstance(event, ev.RetryBudgetDenied):
        return f"scope {event.scope}"
    if isinstance(event, ev.NoReplicaAvailable):
        return f"{event.detail} (excluded {', '.join(event.excluded) or 'none'})"
    if isinstance(event, ev.RequestCompleted):
        order = {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 2}
        keys = sorted(event.usage, key=lambda key: (order.get(key, 3), key))
        usage = " ".join(f"{key}={event.usage[key]}" for key in keys)
        return f"{event.finish_reason} {usage}".strip()
    if isinstance(event, ev.RequestFailed):
        partial = "partial output" if event.partial_output else "nothing delivered"
        return f"{event.code}: {partial}, {event.delivered_output_tokens} tokens delivered"
    if isinstance(event, ev.RequestCancelled):
        return event.reason
    return ""


def _clock(at: Any) -> str:
    return str(at.strftime("%H:%M:%S.%f")[:-3])


def _pool(pool: Mapping[str, Any]) -> str:
    """A placement's pool snapshot as ``[w1 load 0, w2 load 3 out]``: each replica's load
    (this gateway's attempts and the others'), ``out`` when it was not available."""
    views = []
    for view in pool.get("replicas", ()):
        load = view.get("outstanding", 0) + view.get("others_load", 0)
        views.append(f"{view['id']} load {load}" + ("" if view.get("available", True) else " out"))
    return "[" + ", ".join(views) + "]"


def _short(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(str(item) for item in value) + "]"
    return str(value)
