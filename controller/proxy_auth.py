"""Who may report for which proxy id: the credentials of routing reports, and refusals logged once.

A routing poll that carries a report (:class:`pdscope.routing.ProxyReport`) claims a part of the
pools' limits for the id it names. :class:`ProxyCredentials` says whether the poll's bearer token
speaks for that id. Two kinds, either or both:

- the fleet's proxy secret (``$controller.proxy_secret_env``): the token of id X is
  :func:`pdscope.routing.proxy_token` (HMAC-SHA256 of X), which each proxy derives from its own
  id. A k8s Deployment's pods have generated names, so no per-pod token can be provisioned
  ahead; every pod gets the one secret and computes its own token;
- named tokens (``$controller.proxy_tokens_env``, ``name:token``): a token speaks for the id equal
  to its name, or beginning with ``name:`` or ``name/`` (a host's proxy and its workers).

No header (or not ``Bearer``): 401. A token that does not speak for the id: 403. Neither kind
configured: every report passes (open mode; the registry then bounds the live ids tighter).

:class:`EpisodeLog` logs a refusal once per episode: when a key is first refused, and again only
after it has gone ``quiet_s`` without one. It never raises and holds a bounded number of keys.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pdscope.routing import proxy_token

MAX_EPISODE_KEYS = 1024


@dataclass(frozen=True, slots=True)
class Refusal:
    """A report refused for its credentials: the HTTP status, the outcome counted, the detail sent."""

    status: int
    outcome: str
    detail: str


def name_covers(name: str, proxy_id: str) -> bool:
    """Whether a named token's ``name`` speaks for ``proxy_id``: the id, ``name:...`` or ``name/...``."""
    return proxy_id == name or proxy_id.startswith((name + ":", name + "/"))


class ProxyCredentials:
    """The proxy credentials the controller knows. Pure: no I/O; ``check`` never raises."""

    def __init__(
        self,
        tokens: Mapping[str, str] | None,
        secret: str | None,
        *,
        tokens_env: str = "PDSCOPE_PROXY_TOKENS",
        secret_env: str = "PDSCOPE_PROXY_SECRET",
    ) -> None:
        self.tokens = dict(tokens or {})  # token -> name (the id it speaks for)
        self.secret = secret or None
        self.tokens_env, self.secret_env = tokens_env, secret_env

    @property
    def required(self) -> bool:
        return bool(self.tokens) or self.secret is not None

    def check(self, authorization: str | None, proxy_id: str) -> Refusal | None:
        """None when the poll may report under ``proxy_id`` (or nothing is required), else why not."""
        if not self.required:
            return None
        scheme, _, raw = (authorization or "").partition(" ")
        token = raw.strip()
        if scheme.lower() != "bearer" or not token:
            return Refusal(401, "unauthenticated", self._how())
        if self.secret is not None and hmac.compare_digest(
            proxy_token(self.secret, proxy_id).encode(), token.encode()
        ):
            return None
        name = self._name_of(token)
        if name is not None and name_covers(name, proxy_id):
            return None
        if name is None and self.secret is None:
            return Refusal(401, "unauthenticated", self._how())
        if name is not None:
            why = (
                f"it is ${self.tokens_env}'s {name!r}: it speaks for {name!r}, {name}:... and {name}/... only"
            )
        else:
            why = f"it is not this id's (HMAC-SHA256 of ${self.secret_env} and the id)"
        return Refusal(403, "wrong_id", f"this token does not speak for proxy id {proxy_id!r}: {why}")

    def _name_of(self, token: str) -> str | None:
        found = None
        for known, name in self.tokens.items():  # every entry compared: no early exit to time
            if hmac.compare_digest(known.encode(), token.encode()):
                found = name
        return found

    def _how(self) -> str:
        kinds = []
        if self.secret is not None:
            kinds.append(
                f"the token derived from ${self.secret_env} and the proxy id (proxy.controller_secret_env)"
            )
        if self.tokens:
            kinds.append(f"a token of ${self.tokens_env} named for the proxy id (proxy.controller_token_env)")
        return "a routing poll that reports a proxy needs Authorization: Bearer <" + " or ".join(kinds) + ">"


class EpisodeLog:
    """Log lines by key, once per episode: an episode ends after ``quiet_s`` without the key."""

    def __init__(self, logger: logging.Logger, quiet_s: float, clock: Callable[[], float]) -> None:
        self.logger = logger
        self.quiet_s = quiet_s
        self.clock = clock
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def note(self, key: str, level: int, msg: str, *args: object) -> bool:
        """Log ``msg`` when ``key`` starts an episode; True when it was logged."""
        now = self.clock()
        with self._lock:
            last = self._last.get(key)
            self._last[key] = now
            if len(self._last) > MAX_EPISODE_KEYS:
                self._last = {k: t for k, t in self._last.items() if now - t <= self.quiet_s}
                self._last[key] = now
        if last is not None and now - last <= self.quiet_s:
            return False
        self.logger.log(level, msg, *args)
        return True
