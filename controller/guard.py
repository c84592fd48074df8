"""The control API's front door (pure ASGI, in front of FastAPI): auth, then a bounded body.

For every request that may change something (any method but GET, HEAD and OPTIONS), in
this order, before the application sees it:

1. the bearer token is checked (401, or 403 when no token is configured): nothing of the
   body is read for a caller without a valid token; a client address past its wrong-token
   limit gets 429 with ``Retry-After``, its token not compared (``pdscope.auththrottle``);
2. ``X-Actor`` must be UTF-8 (400 naming the header);
3. the body is read up to ``max_body_bytes`` (413 past it, by ``Content-Length`` at once or
   while reading), within ``read_timeout_s`` (408);
4. a JSON body nested deeper than :data:`MAX_JSON_DEPTH` is a 422 naming ``body`` (the
   parser would otherwise recurse into a 500).

The identity and the sanitised ``X-Actor`` go to the app in ``scope["state"]``; the body is
replayed to it unchanged.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controller.auth import Authenticator, AuthError, sanitise_actor

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
MAX_JSON_DEPTH = 32
READ_TIMEOUT_S = 10.0


def json_too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Does any array/object nest deeper than ``limit`` (strings skipped)? Linear, no recursion."""
    depth = 0
    in_str = escaped = False
    for b in body:
        if in_str:
            if escaped:
                escaped = False
            elif b == 0x5C:  # backslash
                escaped = True
            elif b == 0x22:
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b in (0x5B, 0x7B):
            depth += 1
            if depth > limit:
                return True
        elif b in (0x5D, 0x7D):
            depth -= 1
    return False


def client_address(scope: Scope) -> str:
    """The peer's address (behind a reverse proxy: the proxy's), the key wrong tokens are counted by."""
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


class _Refused(Exception):
    def __init__(self, status: int, detail: Any, headers: dict[str, str] | None = None) -> None:
        super().__init__(str(detail))
        self.status, self.detail, self.headers = status, detail, headers or {}


async def _answer(send: Send, exc: _Refused) -> None:
    body = json.dumps({"detail": exc.detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class RequestGuard:
    def __init__(
        self, app: ASGIApp, auth: Authenticator, max_body_bytes: int, read_timeout_s: float = READ_TIMEOUT_S
    ) -> None:
        self.app = app
        self.auth = auth
        self.max_body = max_body_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in SAFE_METHODS:
            await self.app(scope, receive, send)
            return
        try:
            body = await self._admit(scope, receive)
        except _Refused as exc:
            await _answer(send, exc)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _admit(self, scope: Scope, receive: Receive) -> bytes:
        headers: dict[bytes, bytes] = {}
        for k, v in scope.get("headers", ()):
            headers.setdefault(k.lower(), v)
        auth_raw = headers.get(b"authorization")
        try:
            identity = self.auth.identify(
                None if auth_raw is None else auth_raw.decode("latin-1"), source=client_address(scope)
            )
        except AuthError as exc:
            raise _Refused(exc.status, exc.detail, exc.headers()) from None
        try:
            actor = sanitise_actor(headers.get(b"x-actor"))
        except ValueError as exc:
            raise _Refused(400, [{"field": "X-Actor", "reason": str(exc)}]) from None
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                raise _Refused(400, [{"field": "Content-Length", "reason": "not a number"}]) from None
            if declared > self.max_body:
                raise _Refused(413, f"request body over {self.max_body} bytes")
        try:
            body = await asyncio.wait_for(self._read(receive), timeout=self.read_timeout_s)
        except TimeoutError:
            raise _Refused(408, f"request body not received within {self.read_timeout_s:g}s") from None
        ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if body and ctype.endswith(b"json") and json_too_deep(body):
            raise _Refused(
                422, [{"field": "body", "reason": f"JSON nested deeper than {MAX_JSON_DEPTH} levels"}]
            )
        state = scope.setdefault("state", {})
        state["identity"] = identity
        state["x_actor"] = actor
        return body

    async def _read(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise _Refused(400, "client went away before sending the body")
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise _Refused(413, f"request body over {self.max_body} bytes")
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)
