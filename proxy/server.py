"""How the proxy is served: uvicorn (httptools, uvloop) with a bound on reading each request.

The bound itself is :func:`pdscope.httpserve.read_timeout_protocol` (shared with the collector
and the controller): here it covers the whole request, headers and body, within
``timeout_s`` of its first byte, and counts a closed connection by phase (``headers``,
``body``). The clock stops when the request is in: a long streamed answer is not bounded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdscope.httpserve import read_timeout_protocol

__all__ = ["read_timeout_protocol", "uvicorn_config"]


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
