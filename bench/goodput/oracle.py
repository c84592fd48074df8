"""A fixed routing table served like the controller's ``GET /v1/routing`` (the oracle contender).

The oracle is what a perfect controller could reach: weights and admission limits set by
hand for the fault from its first second. It runs in a thread of the benchmark process.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class StaticTable:
    """Serves whatever :meth:`set` last stored, with ``ETag`` = its version."""

    def __init__(self) -> None:
        holder: dict[str, bytes] = {"body": b"{}", "etag": b'"0"'}
        self._holder = holder

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/v1/routing":
                    self.send_response(404)
                    self.end_headers()
                    return
                body, etag = holder["body"], holder["etag"].decode()
                if self.headers.get("If-None-Match") == etag:
                    self.send_response(304)
                    self.send_header("ETag", etag)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("ETag", etag)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="oracle-table", daemon=True)

    def set(self, table: dict[str, Any]) -> None:
        self._holder["body"] = json.dumps(table).encode()
        self._holder["etag"] = f'"{table["version"]}"'.encode()

    def __enter__(self) -> StaticTable:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def oracle_table(instances: list[tuple[str, str, str, str]], weights: dict[str, float],
                 limits: dict[str, int | None], wait_s: float | None = None) -> dict[str, Any]:
    """``instances``: (name, pool, role, url); ``limits``: pool -> max in-flight requests;
    ``wait_s``: the longest wait for an admission slot where a pool has a limit."""
    return {
        "version": 1, "generated_at": 0.0, "mode": "enforce", "enforce": True,
        "instances": [{"name": n, "pool": p, "role": r, "url": u, "weight": weights.get(n, 1.0),
                       "drained": False, "reason": "Oracle"} for n, p, r, u in instances],
        "pools": [{"name": pool, "role": pool, "weight": 1.0, "max_inflight_requests": lim,
                   "max_inflight_kv_bytes": None, "max_queue_wait_s": None if lim is None else wait_s,
                   "reason": "Oracle"} for pool, lim in limits.items()],
    }
