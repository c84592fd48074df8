"""How the proxy is served: uvicorn (httptools, uvloop) with a bound on reading each request.

uvicorn bounds the idle time between requests on a keep-alive connection
(``timeout_keep_alive``) but not the time a client takes to send a request: a client
that connects and sends nothing, or half the headers, or half the body, holds its
socket forever. :func:`read_timeout_protocol` makes uvicorn's httptools protocol close a
connection whose request (headers and body) has not fully arrived within
``timeout_s`` of its first byte (or of the connection, for the first request), and
count it by phase (``headers``, ``body``). The clock stops when the request is in:
a long streamed answer is not bounded here. While the proxy itself has paused reading
(a pipelined request waiting behind the one being answered, or a body the app has not
taken yet), the wait is the proxy's, not the client's, and the clock starts over.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def read_timeout_protocol(timeout_s: float, on_timeout: Callable[[str], None]) -> type[asyncio.Protocol]:
    """An ``HttpToolsProtocol`` subclass for ``uvicorn.Config(http=...)``."""

    class ReadTimeoutProtocol(HttpToolsProtocol):
        _read_timer: asyncio.TimerHandle | None = None
        _read_phase = "headers"

        def _arm(self, phase: str) -> None:
            self._disarm()
            self._read_phase = phase
            self._read_timer = self.loop.call_later(timeout_s, self._read_expired)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _read_expired(self) -> None:
            self._read_timer = None
            if self.transport.is_closing():
                return
            if self.flow is not None and self.flow.read_paused:
                self._arm(self._read_phase)  # we stopped reading, not the client
                return
            on_timeout(self._read_phase)
            self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm("headers")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._read_timer is None:
                self._arm("headers")

        def on_headers_complete(self) -> None:
            self._read_phase = "body"  # the same clock: the whole request within timeout_s
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def timeout_keep_alive_handler(self) -> None:
            self._disarm()
            super().timeout_keep_alive_handler()

    return ReadTimeoutProtocol


def uvicorn_config(
    app: Any,
    host: str,
    port: int,
    *,
    read_timeout_s: float,
    on_read_timeout: Callable[[str], None],
    loop: str = "auto",
    **kw: Any,
) -> Any:
    """The proxy's uvicorn config: httptools with the read bound, no access log."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop=loop,
        http=read_timeout_protocol(read_timeout_s, on_read_timeout),
        access_log=False,
        lifespan="on",
        **kw,
    )
