"""How pdscope's HTTP services are served: uvicorn's httptools protocol with a bound on reading a request.

uvicorn bounds the idle time between requests on a keep-alive connection
(``timeout_keep_alive``) and, with ``limit_concurrency``, answers 503 past a number of
connections, but it has no bound on the time a client takes to send a request: a client that
connects and sends nothing, or half the headers, holds its socket (and, under
``limit_concurrency``, a slot) forever. :func:`read_timeout_protocol` makes the protocol close a
connection whose request has not arrived within ``timeout_s`` of its first byte (or of the
connection, for the first request) and reports the phase it was in (``headers``, ``body``) to
``on_timeout``. With ``through_body`` the bound covers headers and body (the proxy); without it,
only the headers (the collector and the controller, whose apps bound the body themselves).

The clock stops when the request (or its headers) is in: a long answer is not bounded here.
While the server itself has paused reading (a pipelined request waiting behind the one being
answered, or a body the app has not taken yet), the wait is the server's, not the client's,
and the clock starts over. Used by the services' start-up code only; no I/O of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)


def read_timeout_protocol(
    timeout_s: float, on_timeout: Callable[[str], None], *, through_body: bool = True
) -> type[asyncio.Protocol]:
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
            if through_body:
                self._read_phase = "body"  # the same clock: the whole request within timeout_s
            else:
                self._disarm()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def timeout_keep_alive_handler(self) -> None:
            self._disarm()
            super().timeout_keep_alive_handler()

    return ReadTimeoutProtocol


def _log_timeout(phase: str) -> None:
    log.debug("closed a connection that sent no complete request %s in time", phase)


def server_options(
    header_timeout_s: float, max_connections: int, on_timeout: Callable[[str], None] = _log_timeout
) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments for the collector and the controller: a request's headers
    within ``header_timeout_s`` (the body is the app's to bound), and past ``max_connections`` open
    connections a request is answered 503 (uvicorn's ``limit_concurrency``)."""
    return {
        "http": read_timeout_protocol(header_timeout_s, on_timeout, through_body=False),
        "limit_concurrency": max_connections,
    }
