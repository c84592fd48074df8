"""What every pdscope HTTP server bounds per client: header time, connections, wrong tokens."""

from __future__ import annotations

from pydantic import Field

from pdscope.config.base import Count1M, Count100k, DaySeconds, Seconds, _Frozen


class AuthThrottleSettings(_Frozen):
    """How wrong bearer tokens from one client address are throttled (``pdscope.auththrottle``)."""

    max_failures: Count100k = Field(
        default=20,
        description="wrong tokens one client address may send within window_s; past it, 429 "
        "with Retry-After for block_s, its token not even compared",
    )
    window_s: DaySeconds = Field(default=60.0, description="the window max_failures counts in")
    block_s: DaySeconds = Field(default=300.0, description="how long an address is refused")
    max_sources: Count1M = Field(
        default=10_000,
        description="client addresses remembered; past it the least recently seen is forgotten",
    )


class _HTTPServerSettings(_Frozen):
    """What a pdscope HTTP server (the controller's API, the collector's receiver) bounds per client."""

    header_timeout_s: Seconds = Field(
        default=10.0,
        description="time a client has to send a request's headers (from its first byte, or from "
        "connecting); then the connection is closed",
    )
    max_connections: Count1M = Field(
        default=1000, description="open connections served at once; a request past it is answered 503"
    )
    auth_throttle: AuthThrottleSettings = Field(
        default=AuthThrottleSettings(),
        description="wrong bearer tokens from one client address: counted, logged once per window, throttled",
    )
