"""The fleet's admin API (pure ASGI, JSON), used by ``pdscope sim fault`` and tests.

    GET    /instances        [{role, name, url, up}]
    GET    /faults           {"faults": [{id, active, kind, ...}]}
    POST   /faults           a FaultSpec as JSON -> {"id": n}; 400 with the problems if invalid
    DELETE /faults           clear every fault -> {"cleared": n}
    DELETE /faults/<id>      remove one -> 200, or 404
    GET    /stats            event-loop lag: {loop_lag_max_s, loop_lag_p99_s, trustworthy, ...}
    POST   /stats/reset      start a new lag window

It only translates HTTP to Fleet calls; it holds no state of its own.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pdscope.config import ConfigError
from simulator.faults import parse_fault
from simulator.server import Receive, Scope, Send, _json, _read_body

if TYPE_CHECKING:
    from simulator.fleet import Fleet


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
        elif path == "/stats/reset" and method == "POST":
            fleet.lag.reset()
            await _json(send, 200, fleet.lag.stats())
        else:
            await _json(send, 404, {"detail": "Not Found"})
