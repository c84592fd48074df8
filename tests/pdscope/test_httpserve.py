"""pdscope.httpserve: a connection that does not finish its request headers in time is closed."""

from __future__ import annotations

import socket
import time

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from pdscope.httpserve import server_options
from tests.support.serving import serve_in_thread

GENEROUS_S = 15.0  # a closed connection well within this passes; the bound under test is 0.5 s


async def _ok(_request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


APP = Starlette(routes=[Route("/", _ok)])


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def closed_by_server(sock: socket.socket, deadline_s: float = GENEROUS_S) -> bool:
    """Read until the server closes (True) or the deadline passes (False); what it answers is skipped."""
    end = time.monotonic() + deadline_s
    while (left := end - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if sock.recv(4096) == b"":
                return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
    return False


@pytest.mark.parametrize(
    "sent",
    [
        b"",  # connects, sends nothing
        b"GET / HTTP/1.1\r\nHost: x\r\n",  # a request line and a header, never finished
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\nX-Slow: 1",  # a 2nd, partial
    ],
)
def test_partial_headers_are_closed_within_the_bound(sent: bytes) -> None:
    phases: list[str] = []
    opts = server_options(0.5, 100, on_timeout=phases.append)
    with serve_in_thread(APP, http=opts["http"]) as url:
        slow = connect(url)
        slow.sendall(sent)
        good = connect(url)  # served meanwhile
        good.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert closed_by_server(good)
        assert closed_by_server(slow), "the partial request's connection was held open"
        slow.close()
        good.close()
    assert phases == ["headers"]


def test_the_bound_is_only_the_headers_a_served_request_is_not_cut() -> None:
    phases: list[str] = []
    opts = server_options(0.5, 100, on_timeout=phases.append)
    with serve_in_thread(APP, http=opts["http"]) as url:
        s = connect(url)
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        s.settimeout(5)
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        s.close()
    assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"ok")
    assert phases == []


def test_server_options_bound_concurrency() -> None:
    assert server_options(10.0, 7)["limit_concurrency"] == 7
