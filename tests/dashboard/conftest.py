"""Fixtures for the dashboard tests: a seeded store with its config, and a tiny
stand-in controller that records every request and answers like the real API."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from dashboard.seed import SeedSpec, SeedSummary, fleet_config_yaml, seed_store

APP = Path(__file__).resolve().parents[2] / "dashboard" / "app.py"
TOKEN = "test-token-123"
USER_TOKEN = "carol-token-456"  # a user's own controller API token (identity "carol")


@dataclass
class Seeded:
    url: str
    config: Path
    summary: SeedSummary
    spec: SeedSpec


def make_seeded(tmp: Path, controller_port: int = 1, **spec_kw: Any) -> Seeded:
    spec = SeedSpec(end=time.time(), **spec_kw)
    url = f"sqlite:///{tmp / 'store.db'}"
    summary = seed_store(url, spec)
    config = tmp / "pdscope.yaml"
    config.write_text(fleet_config_yaml(spec, url, controller_port=controller_port))
    return Seeded(url, config, summary, spec)


@pytest.fixture(scope="session")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Seeded:
    """A 30-minute history of a 2P+3D fleet (one D degrades), ending now; read-only for tests."""
    return make_seeded(tmp_path_factory.mktemp("seeded"))


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class FakeController:
    url: str
    port: int
    requests: list[Recorded] = field(default_factory=list)
    status: int = 200
    mode: str = "advisory"
    # bearer token -> identity, for GET /v1/whoami (as the controller's api_tokens_env)
    identities: dict[str, str] = field(default_factory=lambda: {TOKEN: "api", USER_TOKEN: "carol"})

    def mutations(self) -> list[Recorded]:
        return [r for r in self.requests if r.method != "GET"]


@pytest.fixture
def fake_controller() -> Iterator[FakeController]:
    """An HTTP server on a free port that answers like the controller API and records requests."""
    state = FakeController(url="", port=0)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            state.requests.append(Recorded(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body))
            if self.path == "/v1/routing":
                out: dict[str, Any] = {"version": 42, "generated_at": time.time(), "mode": state.mode,
                                       "enforce": state.mode == "enforce", "pools": [],
                                       "instances": [{"name": "decode-2", "pool": "decode", "role": "decode",
                                                      "url": "http://x", "weight": 0.25, "drained": False,
                                                      "reason": "NixlSlowTransfers"}]}
                code = 200
            elif self.path == "/v1/whoami":
                given = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
                who = state.identities.get(given)
                out, code = ({"identity": who}, 200) if who else ({"detail": "invalid token"}, 401)
            elif state.status >= 400:
                out, code = {"detail": "invalid token"}, state.status
            else:
                name = self.path.split("/")[3] if self.path.count("/") >= 4 else ""
                out = {"name": name, "weight": (body or {}).get("weight", 0.0), "audit_id": 7}
                code = 200
            payload = json.dumps(out).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_PUT = do_POST = do_DELETE = _answer

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.port = server.server_address[1]
    state.url = f"http://127.0.0.1:{state.port}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
