"""What a resume costs (docs/design.md §12): from the log, and following a live request.

    python ops/bench/resume.py [--deltas 200] [--resumes 20]

Real parts: an embedded PostgreSQL, one sim worker and a gateway (``phasegate serve``)
as processes, raw SSE over HTTP. Printed side by side:

- the original stream: time to its first delta, and its whole duration;
- a resume of the finished request from delta 0 (all of it from the log): time to
  the first resumed delta, and the whole resume;
- a resume from the middle of a finished request;
- a live follow: a resumer started while the request streams, and how far each
  delta reached it behind the original client (the log's lag: a delivery batch and a
  group commit);
- a reattach within the grace (``resume_grace_s``): the client leaves mid-answer and
  comes back at once with ``Last-Event-ID``; time to its first resumed delta (those
  produced meanwhile come from the loop's memory) and to the end.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.store.embedded import EmbeddedPostgres
from app.store.migrate import upgrade
from ops.processes import free_port, phasegate, running, wait_http

MODEL = "sim"


def read_stream(
    url: str,
    method: str,
    path: str,
    *,
    body: object = None,
    headers: dict[str, str] | None = None,
    ids: list[str] | None = None,
) -> list[tuple[float, str]]:
    """(arrival time, SSE id) of every event with an id; the response's request id goes to ``ids``."""
    arrivals = []
    with (
        httpx.Client(base_url=url, timeout=120) as http,
        http.stream(method, path, json=body, headers=headers) as response,
    ):
        if ids is not None:
            ids.append(response.headers["x-request-id"])
        for line in response.iter_lines():
            if line.startswith("id: "):
                arrivals.append((time.perf_counter(), line[4:]))
    return arrivals


def ms(seconds: float) -> str:
    return f"{seconds * 1000:7.1f} ms"


def measure(gateway: str, deltas: int, resumes: int) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "bench"}], "stream": True}
    body |= {"max_tokens": deltas, "ignore_eos": True}
    ids: list[str] = []
    began = time.perf_counter()
    arrivals = read_stream(gateway, "POST", "/v1/chat/completions", body=body, ids=ids)
    (request_id,) = ids
    print(
        f"original stream     first delta {ms(arrivals[0][0] - began)}   whole {ms(arrivals[-1][0] - began)}"
        f"   ({len(arrivals)} events)"
    )
    time.sleep(0.5)  # its end is in the log
    for after, label in ((None, "from the log, all"), (deltas // 2, "from the log, half")):
        headers = {} if after is None else {"last-event-id": str(after)}
        firsts, wholes = [], []
        for _ in range(resumes):
            began = time.perf_counter()
            resumed = read_stream(gateway, "GET", f"/v1/requests/{request_id}/stream", headers=headers)
            firsts.append(resumed[0][0] - began)
            wholes.append(time.perf_counter() - began)
        print(
            f"resume {label:<18} first delta {ms(statistics.median(firsts))}"
            f"   whole {ms(statistics.median(wholes))}   (median of {resumes})"
        )
    # a live follow: the resumer starts once the original is under way
    original: list[tuple[float, str]] = []
    live_ids: list[str] = []
    live = {**body, "messages": [{"role": "user", "content": "live bench"}]}
    thread = threading.Thread(
        target=lambda: original.extend(read_stream(gateway, "POST", "/v1/chat/completions", body=live, ids=live_ids))
    )
    thread.start()
    while not live_ids:
        time.sleep(0.002)
    follower = read_stream(gateway, "GET", f"/v1/requests/{live_ids[0]}/stream")
    thread.join()
    sent = {event_id: at for at, event_id in original}
    behind = sorted(at - sent[event_id] for at, event_id in follower if event_id in sent)
    print(
        f"live follow         behind the client p50 {ms(statistics.median(behind))}"
        f"   p99 {ms(behind[int(0.99 * (len(behind) - 1))])}   ({len(behind)} deltas)"
    )
    firsts, wholes = [], []
    for n in range(resumes):
        leave = {**body, "messages": [{"role": "user", "content": f"reattach bench {n}"}]}
        last, request_id = leave_after(gateway, leave, deltas // 4)
        began = time.perf_counter()
        resumed = read_stream(gateway, "GET", f"/v1/requests/{request_id}/stream", headers={"last-event-id": last})
        firsts.append(resumed[0][0] - began)
        wholes.append(time.perf_counter() - began)
    print(
        f"reattach in grace   first delta {ms(statistics.median(firsts))}"
        f"   to the end {ms(statistics.median(wholes))}   (median of {resumes})"
    )


def leave_after(url: str, body: object, count: int) -> tuple[str, str]:
    """POST, read ``count`` SSE ids and hang up: the last id and the request id."""
    last = ""
    with (
        httpx.Client(base_url=url, timeout=120) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("id: "):
                last = line[4:]
                count -= 1
                if count == 0:
                    break
        return last, response.headers["x-request-id"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deltas", type=int, default=200)
    parser.add_argument("--resumes", type=int, default=20)
    parser.add_argument("--ms-per-token", type=float, default=5.0)
    options = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="phasegate-bench-resume-"))
    workdir.chmod(0o755)
    database = EmbeddedPostgres(workdir / "pg")
    try:
        url = database.start()
        upgrade(url)
        worker_port, gateway_port = free_port(), free_port()
        worker_args = ["--port", str(worker_port), "--engine", "sim", "--model", MODEL]
        worker_args += ["--sim-decode-ms-per-token", str(options.ms_per_token)]
        serve = ["--processes", "1", "--port", str(gateway_port)]
        serve += ["--replica", f"worker=http://127.0.0.1:{worker_port}#w1"]
        serve += ["--model", f"{MODEL}=bench", "--log-level", "warning"]
        with (
            running(phasegate("worker", *worker_args)),
            running(phasegate("serve", *serve), {"DATABASE_URL": url}),
        ):
            wait_http(f"http://127.0.0.1:{worker_port}/v1/ready")
            gateway = f"http://127.0.0.1:{gateway_port}"
            wait_http(gateway + "/readyz")
            measure(gateway, options.deltas, options.resumes)
    finally:
        database.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
