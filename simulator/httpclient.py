"""A small keep-alive HTTP/1.1 client for the load generator (asyncio streams, no TLS).

Why not httpx: on this project's 2-core machines httpx cost ~11 ms of CPU per P/D
request pair, more than the simulator it drives, so the load generator measured
itself. This client does only what ``pdscope load`` needs: POST a JSON body, read the
whole response or iterate its lines (SSE), ``Content-Length`` or chunked bodies, an idle
connection stack per origin. Errors surface as ``HttpClientError`` (a retry may help:
the connection broke or was refused); timeouts are the caller's (``asyncio.timeout``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit


class HttpClientError(Exception):
    """The connection failed or the response was not valid HTTP/1.1."""


class Response:
    def __init__(self, status: int, headers: dict[str, str], conn: _Conn, pool: Pool) -> None:
        self.status_code = status
        self.headers = headers
        self._conn = conn
        self._pool = pool
        self._done = False
        self._chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        self._remaining = int(headers.get("content-length", "0")) if not self._chunked else 0

    async def _chunks(self) -> AsyncIterator[bytes]:
        reader = self._conn.reader
        if not self._chunked:
            if self._remaining:
                yield await reader.readexactly(self._remaining)
            return
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data

    async def aiter_lines(self) -> AsyncIterator[str]:
        buf = b""
        async for data in self._chunks():
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode()
        if buf:
            yield buf.decode()
        self._done = True

    async def aread(self) -> bytes:
        body = b"".join([c async for c in self._chunks()])
        self._done = True
        return body

    async def json(self) -> Any:
        return json.loads(await self.aread())

    def release(self) -> None:
        """Return the connection to the pool if the body was read to the end, else close it."""
        if self._done and not self._conn.closing:
            self._pool.put(self._conn)
        else:
            self._conn.close()


class _Conn:
    def __init__(
        self, origin: tuple[str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.origin = origin
        self.reader = reader
        self.writer = writer
        self.closing = False

    def close(self) -> None:
        self.closing = True
        self.writer.close()


class Pool:
    """Idle connections per (host, port); at most ``max_idle`` kept per origin."""

    def __init__(self, max_idle: int = 1024) -> None:
        self.max_idle = max_idle
        self._idle: dict[tuple[str, int], list[_Conn]] = {}

    def put(self, conn: _Conn) -> None:
        stack = self._idle.setdefault(conn.origin, [])
        if len(stack) < self.max_idle:
            stack.append(conn)
        else:
            conn.close()

    async def _get(self, origin: tuple[str, int]) -> _Conn:
        stack = self._idle.get(origin)
        while stack:
            conn = stack.pop()
            if not conn.reader.at_eof():
                return conn
            conn.close()
        try:
            reader, writer = await asyncio.open_connection(*origin, limit=2**20)
        except OSError as exc:
            raise HttpClientError(f"connect {origin[0]}:{origin[1]}: {exc}") from exc
        return _Conn(origin, reader, writer)

    @contextlib.asynccontextmanager
    async def post(
        self, url: str, payload: dict[str, Any], headers: dict[str, str] | None = None
    ) -> AsyncIterator[Response]:
        """POST ``payload`` as JSON; yields the response with its body unread."""
        parts = urlsplit(url)
        origin = (parts.hostname or "127.0.0.1", parts.port or 80)
        body = json.dumps(payload, separators=(",", ":")).encode()
        head = [
            f"POST {parts.path or '/'} HTTP/1.1",
            f"host: {origin[0]}:{origin[1]}",
            "content-type: application/json",
            f"content-length: {len(body)}",
        ]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        request = ("\r\n".join(head) + "\r\n\r\n").encode() + body
        for attempt in (0, 1):  # a pooled connection the server closed meanwhile gets one retry
            conn = await self._get(origin)
            fresh = attempt == 1
            try:
                conn.writer.write(request)
                status_line = await conn.reader.readuntil(b"\r\n")
                break
            except (OSError, asyncio.IncompleteReadError) as exc:
                conn.close()
                if fresh:
                    raise HttpClientError(f"{url}: {exc}") from exc
        try:
            raw = await conn.reader.readuntil(b"\r\n\r\n")
            status = int(status_line.split(b" ", 2)[1])
            hdrs = {}
            for line in raw.decode("latin-1").split("\r\n"):
                if ":" in line:
                    k, v = line.split(":", 1)
                    hdrs[k.strip().lower()] = v.strip()
            if hdrs.get("connection", "").lower() == "close":
                conn.closing = True
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
            conn.close()
            raise HttpClientError(f"{url}: bad response: {exc}") from exc
        resp = Response(status, hdrs, conn, self)
        try:
            yield resp
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            conn.close()
            raise HttpClientError(f"{url}: {exc}") from exc
        except BaseException:
            conn.close()
            raise
        resp.release()

    async def aclose(self) -> None:
        for stack in self._idle.values():
            for conn in stack:
                conn.close()
        self._idle.clear()
