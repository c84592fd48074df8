"""Free ports now live in :mod:`tests.support.sockets`; this name stays only for the test
packages that still import it (tests/proxy, tests/demo) until they switch."""

from __future__ import annotations

from tests.support.sockets import free_port, free_ports

__all__ = ["free_port", "free_ports"]
