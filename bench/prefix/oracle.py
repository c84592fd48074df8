"""The oracle contender: pdscope's KV-aware proxy whose cache view is the simulator's true cache.

``python -m bench.prefix.oracle CONFIG ADMIN_URL`` serves ``proxy.app.build(settings,
cache_view=OracleView(...))`` as ``pdscope proxy`` does. The view keys a prompt with the
simulator's own tokenizer (``pdscope.simtokenizer``, chat template included) and asks the
simulated fleet's admin API (``POST /admin/cached_tokens``) which instance holds how many of its
tokens, at the moment of routing. The view's methods are synchronous, so the question is a
blocking loopback HTTP call on the proxy's event loop (about a millisecond; it delays the
proxy's other work by that much, which only handicaps the oracle). Everything else -- the cost
model, the load bound, decode-only -- is the proxy's own, as for the other pdscope contenders.
A failed question is counted and answers "nothing cached" (load-only for that request).
"""

from __future__ import annotations

import http.client
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from pdscope import simtokenizer
from proxy.kvindex import chain_keys
from proxy.prefixview import Prompt


class OracleView:
    def __init__(self, admin_url: str, block_size: int, timeout_s: float = 0.5) -> None:
        u = urlsplit(admin_url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.block_size = block_size
        self.timeout_s = timeout_s
        self._conn: http.client.HTTPConnection | None = None
        self.errors = 0

    def prompt(self, endpoint: str, body: Mapping[str, Any]) -> Prompt | None:
        if endpoint.endswith("/chat/completions"):
            messages = body.get("messages")
            if not isinstance(messages, list):
                return None
            ids = simtokenizer.chat_ids(messages)
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                return None
            ids = simtokenizer.text_ids(text)
        keys = tuple(chain_keys(ids, self.block_size))
        return Prompt(keys, len(ids), self.block_size, tuple(ids))

    def cached(self, prompt: Prompt, instances: Sequence[str]) -> dict[str, int]:
        out = dict.fromkeys(instances, 0)
        if prompt.token_ids is None:
            return out
        try:
            got = self._ask(list(prompt.token_ids))
        except (OSError, http.client.HTTPException, ValueError, KeyError):
            self.errors += 1
            self._close()
            return out
        for name in instances:
            out[name] = int(got.get(name, 0))
        return out

    def routed(self, prompt: Prompt, instances: Sequence[str], now: float) -> None:
        return None

    def _ask(self, token_ids: list[int]) -> dict[str, Any]:
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        body = json.dumps({"token_ids": token_ids})
        self._conn.request("POST", "/admin/cached_tokens", body, {"Content-Type": "application/json"})
        resp = self._conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise ValueError(f"admin answered HTTP {resp.status}")
        return dict(json.loads(data)["instances"])

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m bench.prefix.oracle CONFIG ADMIN_URL", file=sys.stderr)
        return 2
    from pdscope.config import load_config
    from proxy.app import build
    from proxy.cli import serve_app

    settings = load_config(argv[0])
    view = OracleView(argv[1], settings.simulator.block_size)
    serve_app(build(settings, cache_view=view), settings, graceful_s=5.0)  # as pdscope proxy serves
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
