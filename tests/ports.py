"""Free 127.0.0.1 TCP ports for tests that start servers (other engineers run tests at once).

Ask the OS (bind port 0) and close: the port is free now, not reserved. When a test needs
several, take them from :func:`free_ports`, which holds every socket until all are picked so
the ports differ; separate :func:`free_port` calls may return the same port twice.
No servers here and no waiting.
"""

from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free a moment ago."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """One port that was free a moment ago (also: a port nothing listens on)."""
    return free_ports(1)[0]
