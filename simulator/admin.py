"""The fleet's admin API (pure ASGI, JSON), used by ``pdscope sim fault`` and tests.

    GET    /instances        [{role, name, url, up}]
    GET    /faults           {"faults": [{id, active, kind, ...}]}
    POST   /faults           a FaultSpec as JSON -> {"id": n}; 400 with the problems if invalid
    DELETE /faults           clear every fault -> {"cleared": n}
    DELETE /faults/<id>      remove one -> 200, or 404
    GET    /stats            event-loop lag: {loop_lag_max_s, loop_lag_p99_s, trustworthy, ...}
    POST   /stats/reset      start a new lag window
    POST   /admin/cached_tokens  {"token_ids": [...], "lora": null} -> {"instances": {name: tokens}}: what a
                             new request with these ids would find in each instance's prefix cache now
                             (the benchmark's oracle); 400 on a bad body

It only translates HTTP to Fleet calls; it holds no state of its own.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pdscope.config import ConfigError
from simulator.faults import parse_fault
from simulator.server import MAX_TOKEN_ID, BadRequest, Receive, Scope, Send, _json, _read_body

if TYPE_CHECKING:
    from simulator.fleet import Fleet

MAX_QUERY_TOKENS = 1 << 20  # token ids one cached_tokens query may carry
MAX_QUERY_BYTES = 16 << 20


def parse_cached_query(body: bytes) -> tuple[list[int], str | None]:
    """``{"token_ids": [...], "lora": str | null}`` -> (ids, lora); ValueError naming the problem."""
    if len(body) > MAX_QUERY_BYTES:
        raise ValueError(f"body over {MAX_QUERY_BYTES} bytes")
    try:
        data: Any = json.loads(body or b"null")
    except ValueError as exc:
        raise ValueError(f"invalid JSON: {exc}") from None
    if not isinstance(data, dict) or set(data) - {"token_ids", "lora"}:
        raise ValueError('the body must be {"token_ids": [...]} (and optionally "lora")')
    ids = data.get("token_ids")
    if not isinstance(ids, list):
        raise ValueError("token_ids must be a list of token ids")
    if len(ids) > MAX_QUERY_TOKENS:
        raise ValueError(f"token_ids: at most {MAX_QUERY_TOKENS} ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise ValueError(f"token_ids must be integers in [0, {MAX_TOKEN_ID}]")
    lora = data.get("lora")
    if lora is not None and (not isinstance(lora, str) or len(lora) > 256):
        raise ValueError("lora must be null or a string of at most 256 characters")
    return ids, lora


class AdminApp:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        fleet = self.fleet
        path: str = scope["path"].rstrip("/") or "/"
        method: str = scope["method"]
        if path == "/instances" and method == "GET":
            await _json(
                send,
                200,
                {
                    "instances": [
                        {"role": role, "name": name, "url": url, "up": fleet.is_up(name)}
                        for role, name, url in fleet.describe()
                    ]
                },
            )
        elif path == "/faults" and method == "GET":
            await _json(send, 200, {"faults": fleet.fault_list()})
        elif path == "/faults" and method == "POST":
            body = await _read_body(receive)
            try:
                data: Any = json.loads(body or b"{}")
                spec = parse_fault(data if isinstance(data, dict) else {})
                fid = fleet.inject(spec)
            except ConfigError as exc:
                await _json(send, 400, {"error": exc.problems})
                return
            except ValueError as exc:
                await _json(send, 400, {"error": [str(exc)]})
                return
            await _json(send, 200, {"id": fid})
        elif path == "/faults" and method == "DELETE":
            await _json(send, 200, {"cleared": fleet.clear_faults()})
        elif path.startswith("/faults/") and method == "DELETE":
            try:
                fid = int(path.rsplit("/", 1)[1])
            except ValueError:
                fid = -1
            if fleet.remove_fault(fid):
                await _json(send, 200, {"removed": fid})
            else:
                await _json(send, 404, {"error": [f"no fault {fid}"]})
        elif path == "/stats" and method == "GET":
            await _json(send, 200, fleet.lag.stats())
        elif path == "/admin/cached_tokens" and method == "POST":
            await self._cached_tokens(receive, send)
        elif path == "/stats/reset" and method == "POST":
            fleet.lag.reset()
            await _json(send, 200, fleet.lag.stats())
        else:
            await _json(send, 404, {"detail": "Not Found"})

    async def _cached_tokens(self, receive: Receive, send: Send) -> None:
        try:
            ids, lora = parse_cached_query(await _read_body(receive, MAX_QUERY_BYTES))
        except BadRequest as exc:
            await _json(send, exc.status, {"error": [str(exc)]})
            return
        except ValueError as exc:
            await _json(send, 400, {"error": [str(exc)]})
            return
        await _json(send, 200, {"instances": self.fleet.cached_tokens(ids, lora)})
