"""The worker protocol's version (docs/worker-protocol.md).

A gateway and a worker built from different releases may frame attempts differently. So
that they refuse each other before an attempt starts, never mid-stream:

- a worker names the version it speaks in its health and info answers (``protocol``);
  the gateway's probe finds a worker that names another version, or none (a worker from
  before versions were carried), incompatible, and sends it nothing until that changes;
- the gateway names its version on every call (the :data:`HEADER`), and a worker refuses
  a call that names another one with 503 ``protocol_mismatch``, which fails that attempt
  before it starts (it is retried elsewhere). A call naming none (curl, by hand) is served.
"""

from __future__ import annotations

from typing import Any

# 2: a start request carries the client's fields as vLLM's server takes them (vllm);
# 3: a choice's tool calls are streamed in pieces (token frames under ``tool_calls``);
# 4: a choice's first token frame says what vLLM's server says of the prompt, where asked;
# 5: a token named by its id (return_tokens_as_token_ids) carries its text in its logprobs;
# 6: a renewal names its number and the last one answered (RENEWAL_SLACK);
# 7: a pooling request is an attempt of its own kind (``pooling``: its route), answered by
#    one done frame carrying the answer (docs/design.md §17)
# 8: a start request may ask for the prompt's log probabilities (``prompt_logprobs``), which a
#    ``prompt_logprobs`` frame says before each choice's first token frame
VERSION = 8
HEADER = "x-phasegate-protocol"

# How far past the TTL of the last renewal the gateway got an answer to (or of the start) a
# later renewal may carry a lease, in TTLs. The worker extends no further, and the gateway's
# view of a lease ends that much later while a renewal is unanswered: so a renewal the
# worker read whose answer was lost never leaves the worker's lease running past the
# gateway's view of it (its LeaseExpired then proves the fence). A whole TTL: a renewal
# read while the lease runs is read within a TTL of the one before, so while answers come
# the cap never bites and a lease lapses exactly as without it (a third of a TTL, the
# renewer's spacing, made leases lapse under load: rounds come a little late, and the cap
# took that from the lease). The cost: after a cut, the fence waits a TTL longer.
RENEWAL_SLACK = 1.0


def incompatibility(answer: Any) -> str | None:
    """Why a worker whose health or info answer is ``answer`` cannot be used by this
    gateway, or None when it speaks this gateway's version."""
    spoken = answer.get("protocol") if isinstance(answer, dict) else None
    if spoken == VERSION and type(spoken) is int:
        return None
    if spoken is None:
        return f"it names no worker protocol version (a worker older than versions); this gateway speaks {VERSION}"
    return f"it speaks worker protocol {spoken!r}; this gateway speaks {VERSION}"
