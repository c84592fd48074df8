"""A fake controller API: serves a routing table and records every request it is sent.

It answers like the controller's HTTP API on the paths its clients use: ``GET /v1/routing``
(the routing table with an ``ETag``; ``304`` to a matching ``If-None-Match``; ``503`` while
``down``), ``GET /v1/whoami`` (the identity of the bearer token, ``401`` for an unknown one),
and any other call (the operator mutations: weights, drains, overrides), which answers with
``status`` and echoes the instance name from the path. Serve :meth:`FakeController.app` with
:mod:`tests.support.serving`; the fields may be changed while it is served.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

Instance = tuple[str, str, str, str, float, bool]


def table(
    instances: list[Instance],
    version: int = 1,
    enforce: bool = True,
    pools: list[dict[str, Any]] | None = None,
    generated_at: float = 0.0,
) -> dict[str, Any]:
    """A routing table as the controller serves it: instances as (name, pool, role, url, weight, drained)."""
    return {
        "version": version,
        "generated_at": generated_at,
        "mode": "enforce" if enforce else "advisory",
        "enforce": enforce,
        "instances": [
            {"name": n, "pool": p, "role": r, "url": u, "weight": w, "drained": d}
            for n, p, r, u, w, d in instances
        ],
        "pools": pools or [],
    }


@dataclass
class Recorded:
    """One request the fake received: the path keeps its query string; header names are lower case."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class FakeController:
    """The controller API's stand-in; ``table`` may be swapped while it is served."""

    table: dict[str, Any]
    down: bool = False  # GET /v1/routing answers 503
    status: int = 200  # what a mutation answers (400 and up: an error body)
    identities: dict[str, str] = field(default_factory=dict)  # bearer token -> identity, for /v1/whoami
    url: str = ""  # set by whoever serves it
    requests: list[Recorded] = field(default_factory=list)
    gets: int = 0  # GETs of the routing table, 304s included
    not_modified: int = 0

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def mutations(self) -> list[Recorded]:
        return [r for r in self.requests if r.method != "GET"]

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/routing", self._routing),
                Route("/v1/whoami", self._whoami),
                Route("/{rest:path}", self._mutation, methods=["GET", "PUT", "POST", "DELETE"]),
            ]
        )

    async def _record(self, request: Request) -> Any:
        raw = await request.body()
        body = json.loads(raw) if raw else None
        query = f"?{request.url.query}" if request.url.query else ""
        self.requests.append(Recorded(request.method, request.url.path + query, dict(request.headers), body))
        return body

    async def _routing(self, request: Request) -> Response:
        await self._record(request)
        self.gets += 1
        if self.down:
            return JSONResponse({"error": "down"}, status_code=503)
        etag = f'"{self.table["version"]}"'
        if request.headers.get("if-none-match") == etag:
            self.not_modified += 1
            return Response(status_code=304, headers={"ETag": etag})
        return JSONResponse(self.table, headers={"ETag": etag})

    async def _whoami(self, request: Request) -> Response:
        await self._record(request)
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        who = self.identities.get(given)
        return (
            JSONResponse({"identity": who})
            if who
            else JSONResponse({"detail": "invalid token"}, status_code=401)
        )

    async def _mutation(self, request: Request) -> Response:
        body = await self._record(request)
        if self.status >= 400:
            return JSONResponse({"detail": "invalid token"}, status_code=self.status)
        parts = request.url.path.split("/")  # /v1/instances/<name>/weight
        name = parts[3] if len(parts) >= 5 else ""
        weight = body.get("weight", 0.0) if isinstance(body, dict) else 0.0
        return JSONResponse({"name": name, "weight": weight, "audit_id": 7})
