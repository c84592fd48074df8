"""The routing table: the wire contract between the controller and the proxy.

The controller serves it at ``GET /v1/routing`` with an ETag (:func:`routing_etag`); the
proxy polls it and applies it. Neither imports the other: both import this module.

The ETag is opaque: a client sends it back in ``If-None-Match`` and gets 304 while the
table is the same, and never compares it or ``version`` with anything else. It carries the
serving process's epoch as well as the version, because a restarted controller may count
versions again from what it stored and so reach a number an earlier process served with
other content; the epoch keeps that from answering 304 to a proxy holding the old table.
``version`` orders the tables of one controller process only.

``leader_epoch`` is another thing: the epoch of the controller leader whose stored decisions the
table serves (bumped on each takeover; the same on every replica). A proxy may poll any
controller replica; it needs neither field to apply the table, and a table without
``leader_epoch`` (an older controller) is as valid.

Several proxies share the pools' limits. Each says who it is on every poll
(:class:`ProxyReport`, as query parameters of ``GET /v1/routing``) and gets its own part of
every pool's limits back in ``RoutingTable.proxy`` (:class:`ProxyShare`); the pools' own
``max_inflight_*`` stay the pool-wide totals. A poll without a report (an older proxy, a
person with curl) gets the table without a share.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# A tenant id and how many a report may name: pdscope.config.tenants' TENANT_ID and MAX_TENANTS (that
# package imports this module, so they are repeated here; a test holds them equal).
TENANT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,62}$")
MAX_TENANTS = 64

# The two roles of a P/D fleet, the one definition every layer uses.
Role = Literal["prefill", "decode"]


class InstanceRoute(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str
    pool: str
    role: Role
    url: str
    weight: float = Field(ge=0.0, description="relative share within its role; 0 = no new work")
    drained: bool = False
    reason: str = ""


class PoolRoute(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str
    role: Role
    weight: float = Field(default=1.0, ge=0.0)
    max_inflight_requests: int | None = Field(default=None, ge=0)
    max_inflight_kv_bytes: int | None = Field(default=None, ge=0)
    max_queue_wait_s: float | None = Field(
        default=None,
        ge=0,
        description="longest a request may wait for a slot in this pool before a 429; "
        "None = the proxy's proxy.admission.queue_timeout_s (which also caps it)",
    )
    reason: str = ""


class PoolShare(BaseModel):
    """One proxy's part of one pool's limits."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    share: float = Field(ge=0.0, le=1.0, description="this proxy's fraction of the pool's limits")
    max_inflight_requests: int = Field(ge=0)
    max_inflight_kv_bytes: int = Field(ge=0)


class ProxyShare(BaseModel):
    """What the polling proxy may admit: its part of each pool's limits, among ``live`` proxies."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str
    live: int = Field(ge=1, description="live proxies the limits are split among (this one included)")
    pools: dict[str, PoolShare]
    tenants: dict[str, float] = Field(
        default_factory=dict,
        max_length=MAX_TENANTS,
        description="tenants on: each reported tenant's fraction of its demand across the live proxies "
        "that this proxy sees (0-1): the proxy scales the tenant's weight by it, so that its share holds "
        "fleet-wide; a tenant missing: 1",
    )


MAX_RATE_ROWS = 100_000  # rows of a served rate table (instances, pairs): a bound on what a proxy accepts


class InstanceRate(BaseModel):
    """What the controller fitted for one instance from the stored traces of its window.

    P: the time a request spends in P (P's queue and its prefill, ``p_done - p_sent``) as
    ``prefill_base_s + prefill_s_per_token x tokens``, where ``tokens`` is the uncached prefill
    tokens ahead of it on P when it was sent plus its own. D: ``handoff_s``, the median time from
    P's answer to D's first token of the handoffs D served. ``samples``: the records the fit used;
    ``error``: the median absolute relative error of the fit on those records (None: too few)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str = Field(min_length=1, max_length=256)
    prefill_base_s: float | None = Field(default=None, ge=0.0, le=3600.0)
    prefill_s_per_token: float | None = Field(default=None, ge=0.0, le=60.0)
    handoff_s: float | None = Field(default=None, ge=0.0, le=3600.0)
    samples: int = Field(default=0, ge=0)
    error: float | None = Field(default=None, ge=0.0)


class PairRate(BaseModel):
    """One P x D link: the median P-answer-to-D-first-token time of the handoffs it carried."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    prefill: str = Field(min_length=1, max_length=256)
    decode: str = Field(min_length=1, max_length=256)
    handoff_s: float = Field(ge=0.0, le=3600.0)
    samples: int = Field(ge=0)


class Rates(BaseModel):
    """The controller's fit of the fleet's rates (the TTFT predictor's prior, ``proxy.predict``),
    fitted at ``fitted_at`` over the ``window_s`` seconds before it. A proxy corrects it online
    from what it sees complete; an instance or pair missing here falls back to the proxy's own
    fit, then to the configured priors."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    fitted_at: float
    window_s: float = Field(ge=0.0)
    instances: list[InstanceRate] = Field(default_factory=list, max_length=MAX_RATE_ROWS)
    pairs: list[PairRate] = Field(default_factory=list, max_length=MAX_RATE_ROWS)


class PairRoute(BaseModel):
    """A P x D pair the proxy should leave out (a probe at most every ``proxy.pair_probe_s``), and why."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    prefill: str = Field(max_length=128)
    decode: str = Field(max_length=128)
    reason: str = Field(max_length=64)
    since: float
    text: str = Field(default="", max_length=500)


class RoutingTable(BaseModel):
    """What the proxy should do now. ``enforce=False`` means advisory: show, don't apply."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    version: int = Field(ge=0)
    generated_at: float
    mode: Literal["advisory", "enforce"]
    enforce: bool
    instances: list[InstanceRoute]
    pools: list[PoolRoute]
    avoid_pairs: list[PairRoute] = Field(
        default_factory=list,
        max_length=MAX_RATE_ROWS,
        description="P x D pairs to leave out of routing, each with its reason: StalePeerAfterRestart (a D's "
        "stale agent for a restarted P; the proxy still sends one probe through each at most every "
        "proxy.pair_probe_s) or IncompatiblePair (never picked, never probed)",
    )
    leader_epoch: int | None = Field(
        default=None,
        ge=0,
        description="epoch of the controller leader whose decisions this table serves "
        "(bumped on each takeover); None: not known",
    )
    proxy: ProxyShare | None = Field(
        default=None,
        description="the polling proxy's part of the pools' limits; None: the poll did not say "
        "who it is, or the controller could not work the share out (the proxy keeps its last)",
    )
    rates: Rates | None = Field(
        default=None,
        description="the rates the controller fitted from the stored traces, with their age and "
        "error: the prior of the proxy's TTFT predictor; None: none fitted (an older controller, "
        "or too few records)",
    )
    proxy_withheld: str | None = Field(
        default=None,
        max_length=500,
        description="why the polling proxy's report got no part although the table is served "
        "(another live process holds its id, or no seat is free); the proxy then drops its part",
    )


def routing_etag(epoch: str, version: int, share: ProxyShare | None = None, rates_tag: str = "") -> str:
    """The strong ETag of table ``version`` served by the controller process ``epoch``, with the
    polling proxy's ``share`` (a proxy whose part changed gets the table again) and the served
    rates' ``rates_tag`` (:func:`rates_digest`, computed once when they change; a proxy gets new
    rates although the table's version is the same)."""
    tail = "" if not rates_tag else f"-r{rates_tag}"
    if share is None:
        return f'"{epoch}-{version}{tail}"'
    digest = hashlib.blake2b(share.model_dump_json().encode(), digest_size=6).hexdigest()
    return f'"{epoch}-{version}-{digest}{tail}"'


def rates_digest(rates: Rates) -> str:
    """A short digest of ``rates``' content, for :func:`routing_etag`."""
    return hashlib.blake2b(rates.model_dump_json().encode(), digest_size=6).hexdigest()


# -- the proxy's report on each poll ----------------------------------------------------

PROXY_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@/-]*$"
_PROXY_ID = re.compile(PROXY_ID_PATTERN)
_BOOT = re.compile(r"^[0-9a-f]{1,32}$")
_POOL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_REPORT_POOLS = 64
_MAX_COUNT = 2**62


def proxy_token(secret: str, proxy_id: str) -> str:
    """The bearer token of ``proxy_id`` under the fleet's proxy secret: hex HMAC-SHA256 of the id.

    A proxy derives its own from its id; the controller checks a report's token against the id
    it reports under, so a token speaks for one id only.
    """
    msg = b"pdscope-proxy-token\x00" + proxy_id.encode()
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


class BadReport(ValueError):
    """A poll's report that cannot be read; ``param`` names the query parameter."""

    def __init__(self, param: str, why: str) -> None:
        super().__init__(f"{param}: {why}")
        self.param = param


@dataclass(frozen=True, slots=True)
class ProxyReport:
    """Who polls and what it holds, sent as the query parameters of ``GET /v1/routing``.

    ``boot`` is random per process and ``started`` its start time (unix seconds): the process
    that holds an id keeps it while it polls; another one under the same id gets the table
    without a part until the holder has been silent for ``controller.proxy_ttl_s`` (then it
    takes the id over: a restart). ``demand`` counts, per pool, the requests that sought
    admission into it since the process started (admitted or rejected); ``inflight`` is what
    the proxy holds now; ``applied`` the table version it applies. ``tenants`` (tenants on) counts,
    per declared tenant, the requests that arrived since the process started: the controller splits
    each tenant's weight among the proxies by it (``ProxyShare.tenants``).
    """

    id: str
    boot: str
    started: float
    applied: int | None = None
    demand: Mapping[str, int] = field(default_factory=dict)
    inflight: Mapping[str, int] = field(default_factory=dict)
    tenants: Mapping[str, int] = field(default_factory=dict)

    def params(self) -> dict[str, str]:
        out = {"proxy": self.id, "boot": self.boot, "started": f"{self.started:.3f}"}
        if self.applied is not None:
            out["applied"] = str(self.applied)
        if self.demand:
            out["demand"] = _pairs(self.demand)
        if self.inflight:
            out["inflight"] = _pairs(self.inflight)
        if self.tenants:
            out["tenants"] = _pairs(self.tenants)
        return out

    @classmethod
    def from_params(cls, q: Mapping[str, str]) -> ProxyReport | None:
        """The report in a poll's query, None when it has none (no ``proxy``). Raises BadReport."""
        pid = q.get("proxy")
        if pid is None:
            return None
        if len(pid) > 128 or not _PROXY_ID.match(pid):
            raise BadReport("proxy", f"not a proxy id (at most 128 of A-Z a-z 0-9 . _ : @ / -): {pid[:40]!r}")
        boot = q.get("boot", "")
        if not _BOOT.match(boot):
            raise BadReport("boot", "must be 1 to 32 lowercase hex digits")
        started = _finite(q.get("started"), "started")
        applied_raw = q.get("applied")
        applied = None if applied_raw is None else _count(applied_raw, "applied")
        return cls(
            pid,
            boot,
            started,
            applied,
            _parse_pairs(q.get("demand", ""), "demand"),
            _parse_pairs(q.get("inflight", ""), "inflight"),
            _parse_pairs(q.get("tenants", ""), "tenants", TENANT_ID, MAX_TENANTS),
        )


def _pairs(counts: Mapping[str, int]) -> str:
    return ",".join(f"{k}:{int(v)}" for k, v in sorted(counts.items()))


def _finite(raw: str | None, param: str) -> float:
    try:
        v = float(raw) if raw is not None else math.nan
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v < 0:
        raise BadReport(param, "must be a non-negative number")
    return v


def _count(raw: str, param: str) -> int:
    if not raw.isdigit() or len(raw) > 19 or int(raw) >= _MAX_COUNT:
        raise BadReport(param, f"must be a non-negative integer below 2**62: {raw[:24]!r}")
    return int(raw)


def _parse_pairs(
    raw: str, param: str, pattern: re.Pattern[str] = _POOL, most: int = MAX_REPORT_POOLS
) -> dict[str, int]:
    """``name:count[,name:count...]``, each name matching ``pattern``, at most ``most`` of them."""
    out: dict[str, int] = {}
    if not raw:
        return out
    if len(raw) > most * 96:
        raise BadReport(param, f"over {most * 96} characters")
    items = raw.split(",")
    if len(items) > most:
        raise BadReport(param, f"more than {most} names")
    for item in items:
        pool, sep, n = item.partition(":")
        if not sep or not pattern.fullmatch(pool):
            raise BadReport(param, f"expected name:count[,name:count...], got {item[:40]!r}")
        if pool in out:
            raise BadReport(param, f"{pool!r} twice")
        out[pool] = _count(n, param)
    return out
