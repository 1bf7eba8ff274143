"""What phasegate does with each request field of ``vllm serve`` 0.32 (its
``ChatCompletionRequest`` and ``CompletionRequest``, declared with their types in
app/contract/requests.py), by class (docs/design.md §14; the table with the test that shows
each: docs/compatibility.md).

- *passed on*: sent to the replica as the client sent it (an ``openai`` replica gets the
  client's JSON value; a worker applies it as vLLM's server does). phasegate reads some
  of them too (``n``, ``max_tokens``, ``logprobs``, ``tools``…), and checks those;
- *phasegate's own*: set by phasegate, never by the client, because they touch other
  tenants or the engine's identity (docs/design.md §13): refused with a 400 that says why;
- *whole only*: passed-on fields vLLM serves only in a whole answer, refused (none now:
  ``prompt_logprobs`` is served in a whole answer, from a worker's frames or an ``openai``
  replica's unstreamed answer);
- *recorded*: fields vLLM accepts and ignores, kept in the log (``metadata``, which audit
  queries want) and not acted on;
- *set by phasegate for itself*: ``stream`` and ``stream_options.include_usage`` are sent
  as phasegate needs them (a streamed upstream gives liveness, fencing and the commit
  point; the usage goes to the log); what the client did not ask for is not shown to it.

Every other declared field is passed on (``requests.PASSED_CHAT``,
``requests.PASSED_COMPLETIONS``). A field vLLM does not declare it accepts and does
nothing with (its request models allow extra fields), so phasegate passes it on unread.
"""

from __future__ import annotations

# phasegate's own, and why a client may not set them
OWN: dict[str, str] = {
    "request_id": "phasegate names each attempt's engine request itself (its x-request-id names the request)",
    "priority": "the scheduling priority is the operator's to give, not a tenant's to take",
    "cache_salt": "phasegate salts the prefix cache per tenant, so that tenants never share cached prefixes",
    "chat_template": "the chat template is the replica's configuration (--chat-template), one for every tenant",
    "kv_transfer_params": "KV-cache transfer is the deployment's, between its own replicas",
    "ec_transfer_params": "encoder-cache transfer is the deployment's, between its own replicas",
    "vllm_xargs": "extra engine arguments are the operator's configuration",
    "mm_processor_kwargs": "the multimodal processor's settings are the replica's configuration",
}

# passed-on fields vLLM serves only in a whole answer, which phasegate would refuse (a 400
# saying why) rather than let vLLM refuse a stream: none now (``prompt_logprobs`` is served
# whole, and refused streamed as vLLM refuses it: app/contract/logprobs.py)
WHOLE_ONLY: dict[str, str] = {}

# accepted and kept in the log; vLLM ignores them
RECORDED = frozenset({"metadata", "store", "service_tier"})

# sent by phasegate as it needs them, whatever the client asked (its answer follows what it asked)
SET_BY_PHASEGATE = frozenset({"stream", "stream_options"})
