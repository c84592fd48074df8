"""The ``tenants`` section: who a request belongs to, and each tenant's share, class, limits and SLOs.

A request's tenant comes from one configured source: a header (``header``, by default
``x-pdscope-tenant``) or its API key (``source: api_key``: the bearer token's SHA-256, hex, looked up in
each tenant's ``api_key_sha256``; the keys themselves never sit in the file). A request with no
tenant is the ``default`` tenant's. A tenant id that is not declared is mapped to ``default`` or
refused (``unknown``): never a new label, so the label's cardinality is the file's.

Off (``enabled: false``, the default), every request is ``default``'s and the proxy admits as before.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pdscope.config.base import Count100k, PositiveFloat, ShortName, _Frozen

DEFAULT_TENANT = "default"
MAX_TENANTS = 64
# a tenant id: what a header may carry and a label may hold
TENANT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,62}$")
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
HEADER_NAME = re.compile(r"^[A-Za-z0-9-]{1,64}$")


class TenantSLO(_Frozen):
    """A tenant's own latency targets; an unset one is the fleet's (``slo``)."""

    ttft_ms: float | None = Field(default=None, gt=0, le=3_600_000)
    """its time to first token target in milliseconds, at the fleet's TTFT percentile"""
    tpot_ms: float | None = Field(default=None, gt=0, le=3_600_000)
    """its time per output token target in milliseconds, at the fleet's TPOT percentile"""


class Tenant(_Frozen):
    weight: float = Field(default=1.0, gt=0, le=1000)
    """its share of each pool's capacity against the other tenants asking at the same time (work-conserving:
    an idle tenant's share goes to the others)"""
    priority: ShortName = "interactive"
    """its priority class, one of ``tenants.classes``: under pressure a lower class waits and is shed first"""
    rate_rps: float | None = Field(default=None, gt=0, le=1_000_000)
    """requests per second it may send (a token bucket of ``burst``); past it, 429 tenant_rate; with several
    proxies, fleet-wide: each holds its share of the tenant's demand"""
    burst: int | None = Field(default=None, ge=1, le=1_000_000)
    """the rate's bucket size in requests; default: one second of rate_rps, at least 1"""
    tokens_per_min: int | None = Field(default=None, ge=1, le=10_000_000_000)
    """tokens (prompt + max_tokens) it may send per minute; past it, 429 tenant_quota; fleet-wide like
    rate_rps"""
    max_queued: Count100k | None = None
    """its own queue bound (requests waiting for room); default: the proxy's waiter bound (1024) shared by
    weight"""
    slo: TenantSLO = TenantSLO()
    """its own SLO targets (alerts, dashboard, attainment metrics); unset: the fleet's"""
    api_key_sha256: list[str] = Field(default_factory=list, max_length=64)
    """with ``source: api_key``: the SHA-256 (hex) of each API key that is this tenant's"""

    @field_validator("api_key_sha256")
    @classmethod
    def _hex(cls, keys: list[str]) -> list[str]:
        for k in keys:
            if not SHA256_HEX.match(k):
                raise ValueError(f"{k[:12]!r}...: not a SHA-256 in lowercase hex (64 characters)")
        return keys


class TenantSettings(_Frozen):
    enabled: bool = False
    """tenant identity, fair shares and per-tenant limits in the proxy's admission; off: one tenant"""
    source: Literal["header", "api_key"] = "header"
    """where a request's tenant comes from: the ``header``, or its bearer API key (``api_key_sha256``)"""
    header: str = "x-pdscope-tenant"
    """the header naming a request's tenant (with ``source: header``)"""
    unknown: Literal["default", "refuse"] = "default"
    """a tenant id that is not declared, or malformed: counted as ``default``'s, or refused (400)"""
    classes: list[ShortName] = Field(
        default_factory=lambda: ["interactive", "batch"], min_length=1, max_length=8
    )
    """the priority classes, highest first"""
    tenants: dict[str, Tenant] = Field(default_factory=lambda: {DEFAULT_TENANT: Tenant()})
    """the declared tenants by id (1-63 of letters, digits, ``_.@-``); ``default`` is added when missing"""
    reserve: float = Field(default=0.3, ge=0, lt=1)
    """with admission by prediction: the last share of the TTFT budget kept for the tenants that have the
    first claim on it. While a tenant of a higher class is busy, a lower class's request is admitted only
    if predicted within (1 - reserve) of the tightest target among them; while tenants of its own class are
    busy, a tenant served past its weight's share among them (its last 10 s) is held to (1 - reserve) of its
    own. So a flood or a batch tenant fills P's queues only so deep, and the others' requests still fit;
    alone, a tenant has the whole budget. 0: off"""
    cost_per_decode_token: PositiveFloat = 1.0
    """a decode token's cost against a prompt token's, in a tenant's service (the fair queue's D counter)"""
    cost_per_kv_token_step: float = Field(default=1 / 2048, ge=0, le=1)
    """the cost, in the fair queue's D counter, of one token of KV held in D for one decode step (where a
    decode step costs ``cost_per_decode_token``): a request of ``L`` tokens of context that decodes ``D``
    tokens holds ``D x L + D (D + 1) / 2`` token-steps. The default values a D's KV as its batch: a D of
    512 Ki tokens of KV that runs 256 sequences at once spends a sequence's step on 2,048 tokens held.
    0: the D counter counts decode steps alone"""

    @field_validator("header")
    @classmethod
    def _header(cls, h: str) -> str:
        if not HEADER_NAME.match(h):
            raise ValueError(f"{h!r}: a header name is 1-64 of letters, digits and '-'")
        return h.lower()

    @field_validator("tenants")
    @classmethod
    def _ids(cls, tenants: dict[str, Tenant]) -> dict[str, Tenant]:
        if len(tenants) > MAX_TENANTS:
            raise ValueError(f"{len(tenants)} tenants: at most {MAX_TENANTS} (each is a metric label)")
        for name in tenants:
            if not TENANT_ID.fullmatch(name):
                raise ValueError(f"tenant id {name!r}: 1-63 of letters, digits, '_', '.', '@', '-'")
        if DEFAULT_TENANT not in tenants:
            tenants = {DEFAULT_TENANT: Tenant(), **tenants}
        return tenants

    @model_validator(mode="after")
    def _classes_and_keys(self) -> TenantSettings:
        if len(set(self.classes)) != len(self.classes):
            raise ValueError(f"classes {self.classes}: a class appears twice")
        seen: dict[str, str] = {}
        for name, t in self.tenants.items():
            if t.priority not in self.classes:
                raise ValueError(f"tenants.{name}.priority {t.priority!r}: not one of classes {self.classes}")
            for k in t.api_key_sha256:
                if k in seen and seen[k] != name:
                    raise ValueError(f"tenants.{name}.api_key_sha256: a key is also {seen[k]!r}'s")
                seen[k] = name
        return self

    def rank(self, tenant: str) -> int:
        """The tenant's class rank: 0 is the highest."""
        return self.classes.index(self.tenants[tenant].priority)
