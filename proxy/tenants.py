"""Who a request belongs to (``tenants``): its tenant from one configured source, never from its body.

With ``tenants.source: header`` the tenant is the value of ``tenants.header``; with ``api_key`` it is
the tenant whose ``api_key_sha256`` holds the SHA-256 of the request's bearer token. No value: the
``default`` tenant. A value that is too long, not a tenant id (``pdscope.config.tenants.TENANT_ID``:
control characters, spaces, non-ASCII...), not declared, or a key no tenant holds is a *problem*:
the request is ``default``'s or refused (400), per ``tenants.unknown``, and the caller counts it by
its reason (:data:`PROBLEMS`, a closed set). A header never sets a weight or a class: those are the
declared tenant's, looked up by id. The value is never echoed back or used as a label.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from pdscope.config.tenants import DEFAULT_TENANT, TENANT_ID, TenantSettings

PROBLEM_TOO_LONG = "too_long"
PROBLEM_MALFORMED = "malformed"
PROBLEM_UNKNOWN = "unknown"
PROBLEM_UNKNOWN_KEY = "unknown_key"
PROBLEMS = (PROBLEM_TOO_LONG, PROBLEM_MALFORMED, PROBLEM_UNKNOWN, PROBLEM_UNKNOWN_KEY)

MAX_ID_BYTES = 63  # TENANT_ID's bound: anything longer is refused before it is decoded
MAX_TOKEN_BYTES = 4096  # a bearer token longer than this is not hashed

_WHAT = {
    PROBLEM_TOO_LONG: "is too long",
    PROBLEM_MALFORMED: "is not a tenant id (1-63 of letters, digits, '_', '.', '@', '-')",
    PROBLEM_UNKNOWN: "names no declared tenant",
    PROBLEM_UNKNOWN_KEY: "is no tenant's API key",
}


@dataclass(frozen=True, slots=True)
class Identity:
    """A request's tenant (a declared id), and the problem its source had (None: none)."""

    tenant: str
    problem: str | None = None


class Identify:
    """Resolves a request's tenant from the raw value of :attr:`header` (bytes, as received)."""

    def __init__(self, ts: TenantSettings) -> None:
        self.settings = ts
        self.by_key = ts.source == "api_key"
        self.header = b"authorization" if self.by_key else ts.header.encode("ascii")
        self.refuse = ts.unknown == "refuse"
        self._keys = {k: name for name, t in ts.tenants.items() for k in t.api_key_sha256}

    def __call__(self, raw: bytes | None) -> Identity:
        if not raw:
            return Identity(DEFAULT_TENANT)
        tenant, problem = self._by_key(raw) if self.by_key else self._by_header(raw)
        return Identity(tenant, None) if problem is None else Identity(DEFAULT_TENANT, problem)

    def _by_header(self, raw: bytes) -> tuple[str, str | None]:
        if len(raw) > MAX_ID_BYTES:
            return DEFAULT_TENANT, PROBLEM_TOO_LONG
        value = raw.decode("latin-1")  # one char a byte: a non-ASCII byte fails the pattern below
        if not TENANT_ID.fullmatch(value):  # fullmatch: '$' alone lets a trailing newline by
            return DEFAULT_TENANT, PROBLEM_MALFORMED
        if value not in self.settings.tenants:
            return DEFAULT_TENANT, PROBLEM_UNKNOWN
        return value, None

    def _by_key(self, raw: bytes) -> tuple[str, str | None]:
        if len(raw) > MAX_TOKEN_BYTES + 7:
            return DEFAULT_TENANT, PROBLEM_TOO_LONG
        scheme, _, token = raw.partition(b" ")
        token = token.strip(b" ")
        if scheme.lower() != b"bearer" or not token:
            return DEFAULT_TENANT, PROBLEM_MALFORMED
        tenant = self._keys.get(hashlib.sha256(token).hexdigest())
        return (DEFAULT_TENANT, PROBLEM_UNKNOWN_KEY) if tenant is None else (tenant, None)

    def message(self, problem: str) -> str:
        """The 400's text for ``problem`` (the value itself is not repeated)."""
        where = "the bearer API key" if self.by_key else f"header {self.settings.header}"
        return f"{where} {_WHAT[problem]} (tenants.unknown: refuse)"
