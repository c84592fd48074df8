"""The proxy's upstream HTTP/1.1 client: one shared keep-alive pool per origin.

Why not httpx on the hot path: at 64 concurrent requests httpx's pool scans every
connection for each request (measured: 40% of the proxy's CPU), so throughput falls as
concurrency grows. This client does the one thing the proxy needs -- POST a JSON body,
read or stream the answer -- with an O(1) idle stack per origin, ``httptools`` for
response parsing and asyncio protocols instead of streams.

Contract:
- :meth:`Upstream.post` sends the request and waits for the status line and headers.
  It never waits forever: ``connect_timeout`` bounds the connect, ``within_s`` bounds the
  wait for headers. It raises only :class:`UpstreamError` subclasses.
- A :class:`Response` must end in :meth:`Response.close` (use ``async with``). Closing a
  response that was not read to the end closes its connection at once, so the server
  sees the client go away (vLLM then aborts the request). A fully read response returns
  its connection to the pool.
- Body reads raise :class:`UpstreamClosed` if the server drops the connection mid-body.
  Callers bound body reads with their own ``asyncio.timeout``.

Error tree (``retry_safe`` says whether the server can have seen the request)::

    UpstreamError
    ├── ConnectFailed     the connection could not be made (retry_safe)
    ├── UpstreamTimeout   no answer in time (the server may be working on it)
    └── UpstreamClosed    the connection broke before or during the answer
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Iterable
from types import TracebackType
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools

HeaderPairs = Iterable[tuple[str, str]]  # a request's own headers, (name, value), after Content-Type


class UpstreamError(Exception):
    """An upstream call failed. ``retry_safe``: the server never saw the request."""

    retry_safe = False


class ConnectFailed(UpstreamError):
    retry_safe = True


class UpstreamTimeout(UpstreamError):
    pass


class UpstreamClosed(UpstreamError):
    pass


class UpstreamResponse(Protocol):
    """What a client's :meth:`UpstreamClient.post` returns (see :class:`Response`)."""

    status: int

    def header(self, name: bytes) -> bytes | None: ...

    async def next_chunk(self) -> bytes | None: ...

    async def read(self) -> bytes: ...

    def close(self) -> None: ...

    async def __aenter__(self) -> UpstreamResponse: ...

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None: ...


async def read_all(resp: UpstreamResponse) -> bytes:
    """The rest of ``resp``'s body, whole."""
    parts = []
    while (chunk := await resp.next_chunk()) is not None:
        parts.append(chunk)
    return b"".join(parts)


class UpstreamClient(Protocol):
    """The seam the proxy's flow uses; :class:`Upstream` here, ``proxy.httpx_upstream`` for comparison."""

    async def post(
        self, base_url: str, path: str, body: bytes, headers: HeaderPairs = (), *, within_s: float
    ) -> UpstreamResponse: ...

    async def aclose(self) -> None: ...


_PAUSE_BYTES = 1 << 20  # stop reading from the socket when this much is buffered


class Response:
    """One upstream answer. Status and headers are set; the body is read or streamed."""

    __slots__ = (
        "_body_waiter",
        "_buffered",
        "_chunks",
        "_conn",
        "_done",
        "_error",
        "_headers_waiter",
        "headers",
        "status",
    )

    def __init__(self, conn: _Conn) -> None:
        self._conn: _Conn | None = conn
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._done = False
        self._error: UpstreamError | None = None
        loop = asyncio.get_running_loop()
        self._headers_waiter: asyncio.Future[None] = loop.create_future()
        self._body_waiter: asyncio.Future[None] | None = None

    def header(self, name: bytes) -> bytes | None:
        """The first header with this lower-case name, or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def complete(self) -> bool:
        """The whole answer has arrived and been read (the next ``next_chunk`` is None). Not part of
        :class:`UpstreamResponse`: the relay looks for it to end the client's stream in the same
        write as D's last event."""
        return self._done and not self._chunks

    # -- fed by the connection ---------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _PAUSE_BYTES and self._conn is not None:
            self._conn.pause()
        self._wake()

    def _finish(self) -> None:
        self._done = True
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if self._done:
            return
        self._error = error
        if not self._headers_waiter.done():
            self._headers_waiter.set_exception(error)
            self._headers_waiter.exception()  # mark retrieved: the caller may be gone
        self._wake()

    def _wake(self) -> None:
        waiter = self._body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- read by the caller ------------------------------------------------------------

    async def next_chunk(self) -> bytes | None:
        """The body bytes that arrived since the last call (every chunk already buffered, joined:
        a relay then makes one write of what one socket read brought), or None at the end. Raises
        UpstreamClosed on a broken answer."""
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                if self._conn is not None:
                    self._conn.resume()  # nothing buffered now (a no-op unless paused)
                return data
            if self._done:
                self._release()
                return None
            if self._error is not None:
                raise self._error
            self._body_waiter = asyncio.get_running_loop().create_future()
            try:
                await self._body_waiter
            finally:
                self._body_waiter = None

    async def aiter(self) -> AsyncIterator[bytes]:
        while (chunk := await self.next_chunk()) is not None:
            yield chunk

    async def read(self) -> bytes:
        return await read_all(self)

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finished(reusable=True)

    def close(self) -> None:
        """Give the connection back if the answer was read in full, else close it now."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finished(reusable=self._done and self._error is None)

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class _Conn(asyncio.Protocol):
    """One keep-alive connection; httptools calls the ``on_*`` methods while parsing."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.closed = False
        self.keep_alive = True
        self.paused = False
        self.used = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes nobody asked for: the connection is unusable
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.response._fail(UpstreamClosed(f"bad HTTP answer from {self.pool.origin}: {exc}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.response is not None:
            # Bodies must be length-delimited or chunked (vLLM's are): a close is a break.
            self.response._fail(UpstreamClosed(f"{self.pool.origin} closed the connection"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        resp = self.response
        assert resp is not None
        resp.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if not resp._headers_waiter.done():
            resp._headers_waiter.set_result(None)

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response._feed(body)

    def on_message_complete(self) -> None:
        resp = self.response
        assert resp is not None
        resp._finish()

    # used by Response
    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def finished(self, reusable: bool) -> None:
        self.response = None
        self.resume()
        if reusable and self.keep_alive and not self.closed:
            self.pool.put(self)
        else:
            self.abort()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class _Pool:
    """Idle connections to one origin, most recently used first."""

    def __init__(self, host: str, port: int, max_idle: int) -> None:
        self.host = host
        self.port = port
        self.origin = f"{host}:{port}"
        self.host_header = self.origin.encode("ascii")
        self.max_idle = max_idle
        self.idle: list[_Conn] = []

    def take(self) -> _Conn | None:
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                return conn
        return None

    def put(self, conn: _Conn) -> None:
        if len(self.idle) < self.max_idle:
            self.idle.append(conn)
        else:
            conn.abort()

    def close(self) -> None:
        while self.idle:
            self.idle.pop().abort()


class Upstream:
    """The shared client. Create once per process (inside the event loop), close at shutdown."""

    def __init__(self, *, connect_timeout: float, max_idle_per_origin: int = 512) -> None:
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle_per_origin
        self._pools: dict[str, _Pool] = {}
        self._closed = False

    def _pool(self, base_url: str) -> _Pool:
        pool = self._pools.get(base_url)
        if pool is None:
            parts = urlsplit(base_url)
            if parts.scheme != "http" or not parts.hostname:
                raise ConnectFailed(f"unsupported upstream URL {base_url!r} (http:// only)")
            pool = _Pool(parts.hostname, parts.port or 80, self.max_idle)
            self._pools[base_url] = pool
        return pool

    async def _connect(self, pool: _Pool) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(lambda: _Conn(pool), pool.host, pool.port)
        except TimeoutError as exc:
            raise ConnectFailed(f"connect to {pool.origin} timed out") from exc
        except OSError as exc:
            raise ConnectFailed(f"connect to {pool.origin} failed: {exc.strerror or exc}") from exc
        return conn

    async def post(
        self, base_url: str, path: str, body: bytes, headers: HeaderPairs = (), *, within_s: float
    ) -> Response:
        """POST ``body`` (JSON) and wait at most ``within_s`` for the answer's headers."""
        if self._closed:
            raise ConnectFailed("upstream client is closed")
        pool = self._pool(base_url)
        head = [
            b"POST ",
            path.encode("ascii"),
            b" HTTP/1.1\r\nHost: ",
            pool.host_header,
            b"\r\nContent-Type: application/json\r\nContent-Length: ",
            str(len(body)).encode("ascii"),
            b"\r\n",
        ]
        for name, value in headers:
            head.append(f"{name}: {value}\r\n".encode("latin-1"))
        head.append(b"\r\n")
        head.append(body)
        payload = b"".join(head)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        conn = pool.take()
        reused = conn is not None
        while True:
            if conn is None:
                conn = await self._connect(pool)
            resp = Response(conn)
            conn.response = resp
            conn.used = True
            assert conn.transport is not None
            conn.transport.write(payload)
            try:
                async with asyncio.timeout_at(deadline):
                    await resp._headers_waiter
                return resp
            except UpstreamClosed:
                resp.close()
                # A reused keep-alive connection the server closed while idle: it never saw
                # this request. Try once more on a fresh connection.
                if reused and resp.status == 0 and not resp._chunks:
                    conn, reused = None, False
                    continue
                raise
            except TimeoutError as exc:
                resp.close()
                raise UpstreamTimeout(f"{pool.origin}{path}: no answer within {within_s:g}s") from exc
            except BaseException:
                resp.close()
                raise

    async def aclose(self) -> None:
        self._closed = True
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
