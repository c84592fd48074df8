"""Who is calling the control API: bearer tokens, their identities, and ``X-Actor``.

* ``controller.api_token_env`` names a variable holding one token; its identity is ``"api"``.
* ``controller.api_tokens_env`` names a variable holding ``name:token[,name:token...]``;
  each token's identity is its name.

The audit actor is the authenticated identity; a valid ``X-Actor`` header is recorded as
``"<identity>:<x-actor>"`` (on behalf of), never alone. ``X-Actor`` is decoded from its
raw bytes as UTF-8 (anything else is refused, not turned into mojibake), then cleaned by
:func:`pdscope.text.clean_name` (NFC, printable, at most 64 characters never inside a combining
sequence; one with nothing visible left counts as absent).

Wrong tokens are throttled by client address (:class:`pdscope.auththrottle.AuthThrottle`, when
the :class:`Authenticator` has one): counted, logged once per address and window, and past the
limit refused with 429 before the token is compared. Pure: no I/O, no framework.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass

from pdscope.auththrottle import INVALID, MISSING, AuthThrottle
from pdscope.config import MAX_TOKEN_NAME_CHARS, Settings, parse_named_tokens
from pdscope.text import clean_name

API_IDENTITY = "api"
MAX_ACTOR_CHARS = 64
# identity + ":" + X-Actor fits the audit table's 128-character actor column
MAX_IDENTITY_CHARS = MAX_TOKEN_NAME_CHARS


class IdentityConfigError(ValueError):
    """A token variable is malformed; the message names the variable."""


class AuthError(Exception):
    """Refused: ``status`` 401 (no or a wrong token), 403 (no token configured) or 429 (an address
    throttled for wrong tokens; ``retry_after`` seconds)."""

    def __init__(self, status: int, detail: str, retry_after: int | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        if self.status == 401:
            return {"WWW-Authenticate": "Bearer"}
        if self.retry_after is not None:
            return {"Retry-After": str(self.retry_after)}
        return {}


def load_tokens(settings: Settings, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """{identity: token} from both variables (the single token is identity ``"api"``)."""
    env = os.environ if environ is None else environ
    c = settings.controller
    try:
        named = parse_named_tokens(env.get(c.api_tokens_env, ""), c.api_tokens_env)
    except ValueError as exc:
        raise IdentityConfigError(str(exc)) from exc
    single = env.get(c.api_token_env) or None
    if single is not None:
        if API_IDENTITY in named and named[API_IDENTITY] != single:
            raise IdentityConfigError(
                f"${c.api_tokens_env}: identity 'api' is ${c.api_token_env}'s; "
                "name the other token differently"
            )
        named[API_IDENTITY] = single
    tokens = list(named.values())
    if len(set(tokens)) != len(tokens):
        raise IdentityConfigError(f"${c.api_tokens_env}: two identities share one token")
    return named


@dataclass(frozen=True)
class Authenticator:
    """Bearer token -> identity (constant-time comparisons against every configured token)."""

    tokens: Mapping[str, str]  # identity -> token
    disabled_detail: str = "mutations are disabled: no API token is configured"
    throttle: AuthThrottle | None = None  # None: wrong tokens are not throttled

    @property
    def configured(self) -> bool:
        return bool(self.tokens)

    def identify(self, authorization: str | None, *, missing_status: int = 403, source: str = "?") -> str:
        """The caller's identity; :class:`AuthError` (401, 429 for a throttled ``source`` address, or
        ``missing_status`` with no tokens) otherwise."""
        if not self.tokens:
            raise AuthError(missing_status, self.disabled_detail)
        wait = None if self.throttle is None else self.throttle.blocked(source)
        if wait is not None:
            raise AuthError(429, "too many wrong tokens from this address: retry later", retry_after=wait)
        scheme, _, given = (authorization or "").partition(" ")
        given = given.strip()
        if scheme.lower() != "bearer" or not given:
            self._failed(source, MISSING)
            raise AuthError(401, "missing 'Authorization: Bearer <token>'")
        found: str | None = None
        raw = given.encode("utf-8", "surrogateescape")
        for identity, token in self.tokens.items():
            if hmac.compare_digest(raw, token.encode("utf-8", "surrogateescape")) and found is None:
                found = identity
        if found is None:
            self._failed(source, INVALID)
            raise AuthError(401, "invalid token")
        return found

    def _failed(self, source: str, reason: str) -> None:
        if self.throttle is not None:
            self.throttle.failed(source, reason)


def sanitise_actor(raw: bytes | None) -> str | None:
    """The ``X-Actor`` header as text, or None when absent or nothing visible is left after cleaning.

    Raises ``ValueError`` when the bytes are not UTF-8 (a client sending Latin-1 or a cut
    multi-byte character must fix it; guessing would record mojibake)."""
    if raw is None:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError("X-Actor must be UTF-8") from exc
    return clean_name(text, MAX_ACTOR_CHARS)


def audit_actor(identity: str, x_actor: str | None) -> str:
    return identity if not x_actor else f"{identity}:{x_actor}"
