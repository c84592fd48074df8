"""Free 127.0.0.1 TCP ports and bound sockets for tests that start servers.

Other engineers run tests on the same machine at once, so a test never picks a fixed port.
:func:`free_ports` and :func:`free_port` are the launcher's (:mod:`pdscope.stack`): they ask the OS
(bind port 0) and close, so the ports are free now, not reserved; ``free_ports(n)`` holds every
socket until all are picked so the ports differ (separate :func:`free_port` calls may return the
same port twice). Where a server takes a socket, :func:`bound_socket` is race-free: the port stays
held until the server listens on it. No servers here, no waiting.
"""

from __future__ import annotations

import socket

from pdscope.stack import free_port, free_ports

__all__ = ["bound_socket", "closed_port_url", "free_port", "free_ports", "url_of"]


def bound_socket() -> socket.socket:
    """A TCP socket bound to 127.0.0.1 on a free port, not yet listening; the caller closes it."""
    # IPPROTO_TCP given explicitly: asyncio sets TCP_NODELAY on a served socket only then.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def url_of(sock: socket.socket) -> str:
    """The base URL of a server on ``sock``."""
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


def closed_port_url() -> str:
    """A URL nothing listens on (connection refused)."""
    return f"http://127.0.0.1:{free_port()}"
