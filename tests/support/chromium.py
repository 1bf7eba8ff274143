"""Headless Chromium for tests, driven over the DevTools protocol on a pipe.

``--remote-debugging-pipe`` makes Chromium read protocol messages from its fd 3 and
write them to its fd 4, each a JSON object ended by a NUL byte: the transport
Playwright uses, with nothing to install but the browser (Debian's ``chromium``, see
``.ci/chromium``). Messages are read synchronously here; events that arrive while a
command waits for its answer are kept for :meth:`Chromium.wait_for`.

    with Chromium.launch() as browser:
        page = browser.new_page(headers={"authorization": "Bearer …"})
        page.goto("http://127.0.0.1:8000/ui/requests/req_1")
        value = page.evaluate("document.title")
        png = page.screenshot()
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The flags the machine's notes give for a root, offline, headless Chromium.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--mute-audio",
    "--remote-debugging-pipe",
)


def find_chromium() -> str | None:
    """``$PHASEGATE_CHROMIUM``, or Debian's ``chromium`` on the PATH."""
    return os.environ.get("PHASEGATE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


class ProtocolError(RuntimeError):
    """Chromium answered a command with an error, or went away."""


class Chromium:
    def __init__(self, process: subprocess.Popen[bytes], to_browser: int, from_browser: int) -> None:
        self.process = process
        self._to = to_browser
        self._from = from_browser
        self._buffer = b""
        self._ids = itertools.count(1)
        self._events: list[dict[str, Any]] = []

    @classmethod
    @contextlib.contextmanager
    def launch(cls, executable: str | None = None, *, timeout: float = 30.0) -> Iterator[Chromium]:
        executable = executable or find_chromium()
        if executable is None:
            raise FileNotFoundError("no chromium found (install it with .ci/chromium)")
        with tempfile.TemporaryDirectory(prefix="phasegate-chromium-") as profile:
            browser_reads, we_write = _high_pipe()
            we_read, browser_writes = _high_pipe()
            # a small trampoline puts the pipe ends where Chromium looks for them, then becomes it
            command = [
                sys.executable,
                "-c",
                _TRAMPOLINE,
                str(browser_reads),
                str(browser_writes),
                executable,
                *FLAGS,
                f"--user-data-dir={profile}",
                "about:blank",
            ]
            log = Path(profile) / "chromium.log"
            with log.open("wb") as log_file:
                process = subprocess.Popen(
                    command,
                    pass_fds=(browser_reads, browser_writes),
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=log_file,
                    start_new_session=True,
                )
            os.close(browser_reads)
            os.close(browser_writes)
            browser = cls(process, we_write, we_read)
            try:
                browser.send("Browser.getVersion", timeout=timeout)
                yield browser
            finally:
                browser.close()

    def send(
        self, method: str, params: dict[str, Any] | None = None, *, session: str | None = None, timeout: float = 30.0
    ) -> dict[str, Any]:
        """Send a command and wait for its answer."""
        message_id = next(self._ids)
        message: dict[str, Any] = {"id": message_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._to, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            answer = self._read(deadline, method)
            if answer.get("id") == message_id:
                if "error" in answer:
                    raise ProtocolError(f"{method}: {answer['error']}")
                return dict(answer.get("result", {}))
            if "method" in answer:
                self._events.append(answer)

    def wait_for(self, event: str, *, session: str | None = None, timeout: float = 30.0) -> dict[str, Any]:
        """The next (or an already received) event named ``event``."""
        deadline = time.monotonic() + timeout
        while True:
            for index, seen in enumerate(self._events):
                if seen["method"] == event and (session is None or seen.get("sessionId") == session):
                    return dict(self._events.pop(index).get("params", {}))
            self._events.append(self._read(deadline, event))

    def new_page(self, *, headers: dict[str, str] | None = None, width: int = 1400, height: int = 900) -> Page:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        page.send("Page.enable")
        page.send("Network.enable")
        if headers:
            page.send("Network.setExtraHTTPHeaders", {"headers": headers})
        page.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        return page

    def close(self) -> None:
        with contextlib.suppress(OSError, ProtocolError):
            self.send("Browser.close", timeout=5)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        # its helpers (zygote, renderers) live in the session it was started in: end them too
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for fd in (self._to, self._from):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _read(self, deadline: float, waiting_for: str) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"chromium did not answer {waiting_for} in time")
            ready, _, _ = select.select([self._from], [], [], left)
            if ready:
                chunk = os.read(self._from, 1 << 16)
                if not chunk:
                    raise ProtocolError(f"chromium exited while we waited for {waiting_for}")
                self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return dict(json.loads(message))


@dataclass
class Page:
    browser: Chromium
    session: str

    def send(self, method: str, params: dict[str, Any] | None = None, *, timeout: float = 30.0) -> dict[str, Any]:
        return self.browser.send(method, params, session=self.session, timeout=timeout)

    def goto(self, url: str, *, timeout: float = 30.0) -> None:
        """Load ``url`` and wait for its load event; an HTTP or network failure raises."""
        navigated = self.send("Page.navigate", {"url": url}, timeout=timeout)
        if navigated.get("errorText"):
            raise ProtocolError(f"loading {url}: {navigated['errorText']}")
        self.browser.wait_for("Page.loadEventFired", session=self.session, timeout=timeout)

    def evaluate(self, expression: str) -> Any:
        """The JSON value of ``expression`` in the page."""
        answer = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in answer:
            raise ProtocolError(f"the page raised: {answer['exceptionDetails']}")
        return answer["result"].get("value")

    def screenshot(self) -> bytes:
        """A PNG of the whole page, not just the viewport."""
        size = self.send("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        shot = self.send("Page.captureScreenshot", {"format": "png", "clip": clip, "captureBeyondViewport": True})
        return base64.b64decode(shot["data"])


_TRAMPOLINE = (
    "import os, sys; os.dup2(int(sys.argv[1]), 3); os.dup2(int(sys.argv[2]), 4); os.execv(sys.argv[3], sys.argv[3:])"
)


def _high_pipe() -> tuple[int, int]:
    """A pipe whose ends are numbered above 4, so redirecting onto fds 3 and 4 cannot clobber them."""
    read, write = os.pipe()
    high = fcntl.fcntl(read, fcntl.F_DUPFD, 10), fcntl.fcntl(write, fcntl.F_DUPFD, 10)
    os.close(read)
    os.close(write)
    return high
