"""A headless Chromium driven over the DevTools protocol (websockets ships with
Streamlit): open a URL, wait until the Streamlit script has finished, read the DOM's
error markers and take a PNG screenshot. Used by the ``browser`` tier only."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from websockets.sync.client import connect

from tests.support.sockets import free_port
from tests.support.waiting import WaitTimeout, wait_until

REPO = Path(__file__).resolve().parents[2]

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--mute-audio",
]

PROBE = (
    """(() => {
  const app = document.querySelector('[data-testid="stApp"]');
  const main = document.querySelector('[data-testid="stMain"]') || document.body;
  return JSON.stringify({
    state: app ? app.getAttribute('data-test-script-state') : null,
    connection: app ? app.getAttribute('data-test-connection-state') : null,
    title: (document.querySelector('h1') || {}).innerText || '',
    exceptions: document.querySelectorAll('[data-testid="stException"]').length,
    errors: Array.from(document.querySelectorAll('[data-testid="stAlertContentError"]'))"""
    """.map(e => e.innerText),
    skeletons: document.querySelectorAll('[data-testid="stSkeleton"]').length,
    charts: document.querySelectorAll('[data-testid="stVegaLiteChart"]').length,
    drawn: document.querySelectorAll('[data-testid="stVegaLiteChart"] canvas, """
    """[data-testid="stVegaLiteChart"] svg').length,
    text: main.innerText.length > 8000
      ? main.innerText.slice(0, 4000) + '\\n…\\n' + main.innerText.slice(-4000) : main.innerText,
  });
})()"""
)


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@dataclass(frozen=True)
class PageShot:
    url: str
    png: bytes
    probe: dict[str, Any]
    seconds: float


class Browser:
    """One Chromium process; ``shoot(url)`` per page. Always ``close()`` it (or use ``with``)."""

    def __init__(self, profile_dir: Path, width: int = 1600, height: int = 1300) -> None:
        exe = chromium_path()
        if exe is None:
            raise RuntimeError("no chromium on PATH")
        self.width, self.height = width, height
        self.proc = subprocess.Popen(
            [
                exe,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={profile_dir}",
                "--remote-debugging-port=0",
                "--remote-debugging-address=127.0.0.1",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.port = self._devtools_port(timeout_s=30.0)
        self._id = 0

    def _devtools_port(self, timeout_s: float) -> int:
        assert self.proc.stderr is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                break
            m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
            if m:
                return int(m.group(1))
        self.close()
        raise RuntimeError("chromium did not start its DevTools endpoint")

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def _call(
        self, ws: Any, method: str, params: dict[str, Any] | None = None, timeout_s: float = 30.0
    ) -> Any:
        self._id += 1
        ws.send(json.dumps({"id": self._id, "method": method, "params": params or {}}))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = json.loads(ws.recv(timeout=max(deadline - time.monotonic(), 0.1)))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
        raise TimeoutError(method)

    def shoot(
        self, url: str, *, timeout_s: float = 60.0, settle_s: float = 2.0, scroll_to: str | None = None
    ) -> PageShot:
        """Open ``url`` in a new tab, wait for the script run to finish and render, screenshot it
        (with ``scroll_to``: scrolled to the first heading that starts with that text)."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/json/new?about:blank", method="PUT")
        with urllib.request.urlopen(req, timeout=10) as resp:
            target = json.loads(resp.read())
        started = time.monotonic()
        try:
            with connect(target["webSocketDebuggerUrl"], max_size=64 * 2**20, open_timeout=10) as ws:
                self._call(
                    ws,
                    "Emulation.setDeviceMetricsOverride",
                    {"width": self.width, "height": self.height, "deviceScaleFactor": 1, "mobile": False},
                )
                self._call(ws, "Page.navigate", {"url": url})
                probe: dict[str, Any] = {}
                done_since: float | None = None
                while time.monotonic() - started < timeout_s:
                    res = self._call(ws, "Runtime.evaluate", {"expression": PROBE, "returnByValue": True})
                    value = res.get("result", {}).get("value")
                    if not isinstance(value, str):  # the document is still being replaced
                        time.sleep(0.25)
                        continue
                    probe = json.loads(value)
                    finished = probe["state"] == "notRunning" and probe["title"] and probe["skeletons"] == 0
                    if finished:
                        done_since = done_since or time.monotonic()
                        if time.monotonic() - done_since >= settle_s:
                            break
                    else:
                        done_since = None
                    time.sleep(0.25)
                if scroll_to is not None:
                    found = self._call(
                        ws,
                        "Runtime.evaluate",
                        {"expression": _scroll(scroll_to), "awaitPromise": True, "returnByValue": True},
                    )
                    probe["scrolled"] = found.get("result", {}).get("value")
                shot = self._call(ws, "Page.captureScreenshot", {"format": "png"})
        finally:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.port}/json/close/{target['id']}", timeout=10
            ):
                pass
        return PageShot(url, base64.b64decode(shot["data"]), probe, time.monotonic() - started)


def _scroll(heading: str) -> str:
    """JS: scroll the first heading starting with ``heading`` to the top, resolved two frames later."""
    return (
        "new Promise(done => { const h = Array.from(document.querySelectorAll('h1, h2, h3'))"
        f".find(e => e.innerText.startsWith({json.dumps(heading)}));"
        " if (h) h.scrollIntoView(); requestAnimationFrame(() => requestAnimationFrame(() => done(!!h))); })"
    )


@contextmanager
def running_dashboard(config: Path, log: Path) -> Iterator[str]:
    """``pdscope dashboard`` on a free port with ``config`` until the block ends; yields its base URL."""
    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdscope.cli", "--config", str(config), "dashboard", "--port", str(port)],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:

        def health() -> bytes:
            if proc.poll() is not None:
                pytest.fail(f"dashboard exited before it was healthy:\n{log.read_text()[-3000:]}")
            with urllib.request.urlopen(f"{base}/_stcore/health", timeout=2) as resp:
                return bytes(resp.read().strip())

        try:
            wait_until(
                "the dashboard to become healthy",
                health,
                done=lambda body: body == b"ok",
                timeout_s=60,
                every_s=0.3,
                ignore=(OSError,),
            )
        except WaitTimeout as exc:
            pytest.fail(f"{exc}\n{log.read_text()[-3000:]}")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
