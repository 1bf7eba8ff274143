"""Lease renewal through the gateway: one call per replica per round, whatever the streams."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from app.config import Timeouts
from statemachine import events as ev
from statemachine.request_state import Outcome
from statemachine.state import fold
from tests.support.gateway import MODEL, RunningGateway, running_gateway
from tests.support.streams import metric
from tests.support.workers import running_worker

# The sim answers this prompt (seed 7) with 118 tokens: at 30 ms each a stream lasts
# about 3.5 s, over three 1 s leases, so it lives only if its lease is renewed (every
# third of one); a lease much shorter than that a loaded machine's renewal can outlast.
PROMPT, SEED, ANSWER_TOKENS = "tell me about leases 8", 7, 118
LEASES = Timeouts(stall_s=2.0, lease_ttl_s=1.0, cancel_ack_s=1.0, first_token_soft_s=2.0, first_token_hard_s=10.0)
STREAMS = 4


def stream(gateway: RunningGateway) -> tuple[str, int]:
    chunks = gateway.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], stream=True, max_tokens=500, seed=SEED
    )
    content = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
    return chunks.response.headers["x-request-id"], content


def test_concurrent_streams_outlive_their_lease_on_shared_renewal_rounds(database_url: str) -> None:
    with (
        running_worker(args=["--sim-decode-ms-per-token", "30"]) as worker,
        running_gateway(database_url, [worker], timeouts=LEASES) as gateway,
    ):
        with ThreadPoolExecutor(STREAMS) as pool:
            results = list(pool.map(lambda _: stream(gateway), range(STREAMS)))
        for request_id, chunks in results:
            events = gateway.events(request_id)
            assert chunks == ANSWER_TOKENS and fold(events).outcome is Outcome.COMPLETED
            assert not [e for e in events if isinstance(e, ev.UpstreamFailed)]
        calls, renewed, expired = (
            asyncio.run(metric(worker.base_url, f"phasegate_worker_{name}_total"))
            for name in ("renew_calls", "leases_renewed", "lease_expiries")
        )
    assert expired == 0
    assert calls >= 5  # the streams outlived several leases: rounds were run
    # each call renewed every held lease (four, but for the ragged start and end);
    # one call per attempt would make the two counts equal
    assert renewed >= 3 * calls
