"""Serve an ASGI app on 127.0.0.1 for a test: in the test's event loop, or in a thread.

:func:`serve` runs uvicorn as a task of the running loop (async tests); :func:`serve_in_thread`
runs it on an event loop of its own in a daemon thread (sync tests, or a test whose own loop
must not starve the server). Both take a free port (or the ``sock`` given, bound and not yet
listening), wait until uvicorn reports it started, yield the base URL, and stop the server
on leaving the block. A server that fails to start fails the test with the reason.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import uvicorn

from tests.support.sockets import bound_socket, url_of
from tests.support.waiting import async_wait_until, wait_until

START_TIMEOUT_S = 10.0


def _server(app: Any, http: Any) -> uvicorn.Server:
    config = uvicorn.Config(
        app, log_level="error", access_log=False, lifespan="on", http=http, timeout_graceful_shutdown=1
    )
    return uvicorn.Server(config)


@asynccontextmanager
async def serve(
    app: Any, *, sock: socket.socket | None = None, http: Any = "httptools", stop_timeout_s: float = 5.0
) -> AsyncIterator[str]:
    """Run ``app`` in this event loop until the block ends; yields its base URL."""
    sock = sock or bound_socket()
    server = _server(app, http)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await async_wait_until(
            "the test server to start", lambda: server.started or task.done(), timeout_s=START_TIMEOUT_S
        )
        if not server.started:  # serve() returned or raised before it listened
            await task
            raise AssertionError("the test server stopped before it started (see the log above)")
        yield url_of(sock)
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(task, stop_timeout_s)
        except TimeoutError:
            task.cancel()
        sock.close()


@contextmanager
def serve_in_thread(
    app: Any, *, sock: socket.socket | None = None, http: Any = "httptools", stop_timeout_s: float = 5.0
) -> Iterator[str]:
    """Run ``app`` on its own event loop in a daemon thread until the block ends; yields its base URL."""
    sock = sock or bound_socket()
    server = _server(app, http)
    # uvicorn installs signal handlers only in the main thread; this one is not.
    thread = threading.Thread(
        target=lambda: asyncio.run(server.serve(sockets=[sock])), name="test-server", daemon=True
    )
    thread.start()
    try:
        wait_until(
            "the test server to start",
            lambda: server.started or not thread.is_alive(),
            timeout_s=START_TIMEOUT_S,
        )
        if not server.started:
            raise AssertionError("the test server stopped before it started (see the log above)")
        yield url_of(sock)
    finally:
        server.should_exit = True
        thread.join(stop_timeout_s)
        sock.close()
