"""What every pdscope HTTP server bounds per client: header time, connections, wrong tokens."""

from __future__ import annotations

from pdscope.config.base import Count1M, Count100k, DaySeconds, Seconds, _Frozen


class AuthThrottleSettings(_Frozen):
    """How wrong bearer tokens from one client address are throttled (``pdscope.auththrottle``)."""

    max_failures: Count100k = 20
    """wrong tokens one client address may send within window_s; past it, 429 with Retry-After for block_s,
    its token not even compared"""
    window_s: DaySeconds = 60.0
    """the window max_failures counts in"""
    block_s: DaySeconds = 300.0
    """how long an address is refused"""
    max_sources: Count1M = 10_000
    """client addresses remembered; past it the least recently seen is forgotten"""


class _HTTPServerSettings(_Frozen):
    """What a pdscope HTTP server (the controller's API, the collector's receiver) bounds per client."""

    header_timeout_s: Seconds = 10.0
    """time a client has to send a request's headers (from its first byte, or from connecting); then the
    connection is closed"""
    max_connections: Count1M = 1000
    """open connections served at once; a request past it is answered 503"""
    auth_throttle: AuthThrottleSettings = AuthThrottleSettings()
    """wrong bearer tokens from one client address: counted, logged once per window, throttled"""
