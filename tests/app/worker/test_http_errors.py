"""A path or method no worker route takes is answered in the protocol's error shape (the fuzz
suite found Starlette's plain-text ``Not Found``), with ``Allow`` kept on a 405. A real worker."""

from __future__ import annotations

import httpx

from tests.support.workers import WorkerProcess


def test_unknown_paths_and_methods_get_the_error_shape(sim_worker: WorkerProcess) -> None:
    with httpx.Client(base_url=sim_worker.base_url, timeout=10) as http:
        missing = http.get("/v1/nothing")
        wrong_method = http.get("/v1/attempts/cancel")
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")
    assert (wrong_method.status_code, wrong_method.json()["error"]["code"]) == (405, "method_not_allowed")
    assert wrong_method.headers["allow"] == "POST"
