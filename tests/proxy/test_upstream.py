"""The lean upstream client against a raw asyncio HTTP server we fully control."""

from __future__ import annotations

import asyncio

import pytest

from proxy.upstream import ConnectFailed, Response, Upstream, UpstreamClosed, UpstreamTimeout
from tests.support.sockets import bound_socket, closed_port_url, url_of
from tests.support.waiting import async_wait_until


class RawServer:
    """Answers each request per ``script``: 'ok', 'chunked', 'close-after', 'silent', 'close-idle'."""

    def __init__(self, script: str) -> None:
        self.script = script
        self.connections = 0
        self.requests = 0
        self.ended = 0  # connections this server has closed
        self.closed_by_peer = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(
                    next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(
                        b":"
                    )[1]
                )
                await reader.readexactly(length)
                self.requests += 1
                if self.script == "truncate":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}")
                    await writer.drain()
                    writer.close()
                    return
                if self.script == "big":
                    payload = bytes(range(256)) * (3 * 4096)  # 3 MiB, more than the pause threshold
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
                    await writer.drain()
                    continue
                if self.script == "silent":
                    await asyncio.sleep(30)  # the behaviour under test: an upstream that never answers
                if self.script == "chunked":
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
                    await writer.drain()
                    try:
                        await asyncio.wait_for(reader.read(1), 5)  # b"" when the client closes
                    finally:
                        self.closed_by_peer.set()
                    return
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}"
                )
                await writer.drain()
                if self.script in ("close-after", "close-idle"):
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.ended += 1


async def _serve(script: str) -> tuple[RawServer, asyncio.Server, str]:
    raw = RawServer(script)
    sock = bound_socket()
    server = await asyncio.start_server(raw.handle, sock=sock)
    return raw, server, url_of(sock)


async def test_keep_alive_reuses_one_connection() -> None:
    raw, server, url = await _serve("ok")
    up = Upstream(connect_timeout=1)
    for _ in range(5):
        async with await up.post(url, "/x", b"{}", within_s=2) as resp:
            assert resp.status == 200 and await resp.read() == b"{}"
            assert resp.header(b"content-type") == b"application/json"
    assert raw.connections == 1 and raw.requests == 5
    await up.aclose()
    server.close()


async def test_a_connection_the_server_closed_while_idle_is_retried_fresh() -> None:
    raw, server, url = await _serve("close-idle")
    up = Upstream(connect_timeout=1)
    for _ in range(3):
        async with await up.post(url, "/x", b"{}", within_s=2) as resp:
            assert await resp.read() == b"{}"
        await async_wait_until(
            "the server to close the idle connection", lambda: raw.ended == raw.connections
        )
    assert raw.requests == 3 and raw.connections == 3
    await up.aclose()
    server.close()


async def test_closing_an_unfinished_stream_closes_the_connection() -> None:
    raw, server, url = await _serve("chunked")
    up = Upstream(connect_timeout=1)
    resp = await up.post(url, "/x", b"{}", within_s=2)
    assert await resp.next_chunk() == b"hello"
    resp.close()
    await asyncio.wait_for(raw.closed_by_peer.wait(), 2)  # the server saw us go
    await up.aclose()
    server.close()


async def test_errors_are_translated() -> None:
    _raw, server, url = await _serve("silent")
    up = Upstream(connect_timeout=1)
    with pytest.raises(UpstreamTimeout):
        await up.post(url, "/x", b"{}", within_s=0.2)
    dead = closed_port_url()
    with pytest.raises(ConnectFailed) as exc_info:
        await up.post(dead, "/x", b"{}", within_s=1)
    assert exc_info.value.retry_safe
    server.close()
    _, server2, url2 = await _serve("truncate")
    async with await up.post(url2, "/x", b"{}", within_s=2) as resp:
        with pytest.raises(UpstreamClosed):
            await resp.read()
    await up.aclose()
    server2.close()


async def test_a_slow_reader_pauses_the_socket_and_still_gets_every_byte() -> None:
    _, server, url = await _serve("big")
    up = Upstream(connect_timeout=1)
    for _ in range(2):  # and the connection is reusable afterwards
        async with await up.post(url, "/x", b"{}", within_s=2) as resp:
            got = bytearray()
            await async_wait_until("the buffer past the pause mark", lambda: _paused(resp))
            while (chunk := await resp.next_chunk()) is not None:
                got += chunk
                await asyncio.sleep(0)
            assert bytes(got) == bytes(range(256)) * (3 * 4096)
    await up.aclose()
    server.close()


def _paused(resp: Response) -> bool:
    """Whether the response's connection has stopped reading from the socket."""
    conn = resp._conn
    return conn is not None and conn.paused
