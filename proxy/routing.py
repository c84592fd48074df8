"""The routing view the proxy follows, and the poller that keeps it current.

The controller serves a :class:`pdscope.routing.RoutingTable` at ``GET /v1/routing`` with
an ETag. :class:`RoutingState` turns the latest table into a :class:`RoutingView`
(per-instance effective weights, drained instances removed, pool admission limits) and
decides what to do when the controller cannot be reached:

    default ──table──► fresh ──poll fails──► static ──fail_static_s──► fallback
     │  ▲               ▲  ▲                    │                          │
     │  └── (start)     │  └───── table or 304 ─┴──────────────────────────┘
     └─poll fails─► never_reached ──table──┘

``static`` keeps the last table; ``fallback``, ``default`` and ``never_reached`` use the
config's pools with equal instance weights and the config's admission defaults divided by
``proxy.expected_replicas`` (``never_reached``: no controller has answered since this proxy
started -- a WARNING says so once).

Several proxies share each pool's limits: every poll carries this proxy's report
(:class:`pdscope.routing.ProxyReport`: its id, its demand and in-flight per pool, the
version it applies) and the table comes back with its part (``RoutingTable.proxy``), which
is the limit this proxy enforces. A table without a part (the controller could not work it
out) keeps the last part for ``fail_static_s``; then, as when the controller is unreachable,
the config's limits divided by ``expected_replicas`` -- never the whole limit, which every
proxy would admit at once. A table that says the part is withheld (``proxy_withheld``: another
live process holds this id, or no seat is free) drops the part at once. A report the controller
refuses (401/403: credentials; 409: an older controller's duplicate id) is polled again without
the report, so the table, its weights and drains, still apply, without a part. Each such
episode is logged once, when it starts. The poller fails over between ``proxy.controller_urls``.

An ``advisory`` table is recorded but not applied. The proxy never stops
serving because of the controller. State changes are logged (WARNING into a degraded
state, INFO out of it); a poll that changes nothing logs nothing above DEBUG.

:class:`RoutingState` is pure (clock passed in); :func:`poll_forever` does the I/O.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import httpx
from pydantic import ValidationError

from pdscope.config import Settings
from pdscope.reasons import Reason
from pdscope.routing import ProxyReport, ProxyShare, RoutingTable, proxy_token

log = logging.getLogger(__name__)

State = Literal["default", "never_reached", "fresh", "static", "fallback", "advisory"]
STATES: tuple[State, ...] = ("default", "never_reached", "fresh", "static", "fallback", "advisory")


@dataclass(frozen=True, slots=True)
class Target:
    """One instance the proxy may send work to."""

    name: str
    pool: str
    url: str
    weight: float  # effective: instance weight x pool weight, > 0


@dataclass(frozen=True, slots=True)
class PoolLimits:
    max_inflight_requests: int
    max_inflight_kv_bytes: int
    max_queue_wait_s: float | None = None  # None: the proxy's configured queue timeout


@dataclass(frozen=True)
class RoutingView:
    """What selection and admission read on every request (immutable; swapped whole)."""

    state: State
    version: int | None
    prefill: tuple[Target, ...]
    decode: tuple[Target, ...]
    limits: dict[str, PoolLimits] = field(default_factory=dict)
    # P -> the Ds the controller said to leave out with it (``RoutingTable.avoid_pairs``), probed at times
    avoid: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # P -> the Ds it must never be paired with (avoid_pairs of reason IncompatiblePair): never probed
    never: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def limits_for(self, pool: str, default: PoolLimits) -> PoolLimits:
        return self.limits.get(pool, default)

    def queue_wait_s(self, default: float) -> float:
        """How long a request may wait for admission: the configured timeout, or less where a pool says so."""
        pools = self._pool_wait_s
        return default if pools is None else min(default, pools)

    @cached_property
    def _pool_wait_s(self) -> float | None:
        # Once per table, not per request: the view is immutable and swapped whole.
        waits = [lim.max_queue_wait_s for lim in self.limits.values() if lim.max_queue_wait_s is not None]
        return min(waits) if waits else None

    @cached_property
    def prefill_pools(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.pool for t in self.prefill))

    @cached_property
    def decode_pools(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.pool for t in self.decode))


def _divided(limit: int, n: int) -> int:
    """One proxy's part of ``limit`` among ``n``: at least 1 of a limit above 0 (0 stays 0: closed)."""
    return 0 if limit <= 0 else max(1, limit // n)


def fallback_limits(settings: Settings) -> PoolLimits:
    """A pool's limits with no part from the controller: the config's, divided by the proxies expected."""
    adm, n = settings.proxy.admission, settings.proxy.expected_replicas
    return PoolLimits(_divided(adm.max_inflight_requests, n), _divided(adm.max_inflight_kv_bytes, n))


def config_view(settings: Settings, state: State, version: int | None = None) -> RoutingView:
    """Equal instance weights (times the config's pool weight) and the config's limits (this proxy's part)."""
    fallback = fallback_limits(settings)
    targets: dict[str, list[Target]] = {"prefill": [], "decode": []}
    limits = {}
    for pool_name, pool in settings.pools.items():
        limits[pool_name] = fallback
        if pool.weight <= 0:
            continue
        for inst in pool.instances:
            targets[pool.role].append(Target(inst.name, pool_name, inst.url, pool.weight))
    return RoutingView(state, version, tuple(targets["prefill"]), tuple(targets["decode"]), limits)


def table_view(table: RoutingTable, settings: Settings, share: ProxyShare | None = None) -> RoutingView:
    """The controller's table applied: drained and zero-weight instances get no new work. Each pool's
    limits are this proxy's part of them (``share``); without one, the table's (or where it sets none,
    the config's) divided by ``proxy.expected_replicas``."""
    adm, n = settings.proxy.admission, settings.proxy.expected_replicas
    pool_weight = {p.name: p.weight for p in table.pools}
    parts = {} if share is None else share.pools
    fallback = fallback_limits(settings)
    limits = {
        name: (
            PoolLimits(parts[name].max_inflight_requests, parts[name].max_inflight_kv_bytes)
            if name in parts
            else fallback
        )
        for name in settings.pools
    }
    for p in table.pools:
        part = parts.get(p.name)
        if part is not None:
            limits[p.name] = PoolLimits(
                part.max_inflight_requests, part.max_inflight_kv_bytes, p.max_queue_wait_s
            )
            continue
        req = adm.max_inflight_requests if p.max_inflight_requests is None else p.max_inflight_requests
        kv = adm.max_inflight_kv_bytes if p.max_inflight_kv_bytes is None else p.max_inflight_kv_bytes
        limits[p.name] = PoolLimits(_divided(req, n), _divided(kv, n), p.max_queue_wait_s)
    targets: dict[str, list[Target]] = {"prefill": [], "decode": []}
    for inst in table.instances:
        weight = inst.weight * pool_weight.get(inst.pool, 1.0)
        if inst.drained or weight <= 0:
            continue
        targets[inst.role].append(Target(inst.name, inst.pool, inst.url.rstrip("/"), weight))
    avoid: dict[str, set[str]] = {}
    never: dict[str, set[str]] = {}
    for pr in table.avoid_pairs:
        (never if pr.reason == Reason.INCOMPATIBLE_PAIR else avoid).setdefault(pr.prefill, set()).add(
            pr.decode
        )
    prefill, decode = _paired(targets["prefill"], targets["decode"], never)
    return RoutingView(
        "fresh",
        table.version,
        prefill,
        decode,
        limits,
        {p: frozenset(ds) for p, ds in avoid.items()},
        {p: frozenset(ds) for p, ds in never.items()},
    )


def _paired(
    prefill: list[Target], decode: list[Target], never: Mapping[str, set[str]]
) -> tuple[tuple[Target, ...], tuple[Target, ...]]:
    """The targets that have a partner they may be paired with: a P every D of which it must never be
    paired with (an incompatible pair) gets no work, nor such a D."""
    if not never:
        return tuple(prefill), tuple(decode)
    ds = {t.name for t in decode}
    ps = [t for t in prefill if not ds <= never.get(t.name, set())]
    if not ps:
        return (), tuple(decode)
    paired_ds = {d for t in ps for d in ds - never.get(t.name, set())}
    return tuple(ps), tuple(t for t in decode if t.name in paired_ds)


class RoutingState:
    """Holds the current view; fed poll results and the time. Not thread-safe (one loop)."""

    def __init__(self, settings: Settings, now: float) -> None:
        self.settings = settings
        self.proxy_id = settings.proxy.id or f"{socket.gethostname()}:{settings.proxy.port}"
        self.boot = secrets.token_hex(8)
        self.started_unix = time.time()
        self.share: ProxyShare | None = None  # the last part of the limits the controller gave
        self.share_at: float | None = None
        self.share_refusal: str | None = None  # why the controller gives this proxy no part, while so
        self.fail_static_s = settings.proxy.fail_static_s
        self.view = config_view(settings, "default")
        self.etag: str | None = None
        self.table: RoutingTable | None = None
        self.last_ok: float | None = None
        self.started = now
        self.poll_failures = 0

    @property
    def state(self) -> State:
        return self.view.state

    def _set(self, view: RoutingView) -> None:
        old, old_version = self.view.state, self.view.version
        self.view = view
        if view.state != old:
            if view.state == "never_reached":
                log.warning(
                    "routing: no controller reached at %s yet; serving with the config's equal weights "
                    "until one answers",
                    self.settings.controller_url,
                )
            elif view.state in ("static", "fallback"):
                log.warning(
                    "routing: controller unreachable, now %s (%s); version %s",
                    view.state,
                    "keeping the last table" if view.state == "static" else "equal weights",
                    view.version,
                )
            else:
                log.info("routing: now %s, table version %s", view.state, view.version)
        elif view.version != old_version:
            log.debug("routing: table version %s", view.version)

    def on_table(self, table: RoutingTable, etag: str | None, now: float) -> None:
        self.table = table
        self.etag = etag
        self.last_ok = now
        if table.proxy is not None and table.proxy.id == self.proxy_id:
            self.share, self.share_at = table.proxy, now
            if self.share_refusal is not None:
                log.info("routing: the controller gives this proxy its part of the limits again")
            self.share_refusal = None
        elif table.proxy_withheld is not None:
            self._no_part(table.proxy_withheld, logging.WARNING)
        if table.enforce:
            self._set(table_view(table, self.settings, self.current_share(now)))
        else:
            self._set(config_view(self.settings, "advisory", table.version))

    def current_share(self, now: float) -> ProxyShare | None:
        """The last part given, while it is younger than ``fail_static_s``."""
        if self.share is None or self.share_at is None or now - self.share_at > self.fail_static_s:
            return None
        return self.share

    def on_refused(self, detail: str, now: float) -> None:
        """The controller refused this proxy's report (401: no credential it knows; 403: one that does
        not speak for this id; 409: an older controller, another process under this id). The poller
        then fetches the table without a report; the part is dropped."""
        self._no_part(detail, logging.ERROR)

    def _no_part(self, detail: str, level: int) -> None:
        """No part from the controller now: drop the last one (it may be another process's); log the
        episode once, when it starts."""
        if self.share_refusal is None:
            log.log(
                level,
                "routing: the controller gives this proxy (%s) no part of the limits: %s; it admits the "
                "limits divided by proxy.expected_replicas and keeps applying tables (logged once while "
                "this goes on)",
                self.proxy_id,
                detail,
            )
        self.share_refusal = detail
        self.share = self.share_at = None

    def report(
        self, demand: dict[str, int], inflight: dict[str, int], tenants: dict[str, int] | None = None
    ) -> ProxyReport:
        """What the next poll tells the controller (``tenants``: each tenant's requests, tenants on)."""
        return ProxyReport(
            self.proxy_id, self.boot, self.started_unix, self.view.version, demand, inflight, tenants or {}
        )

    def on_not_modified(self, now: float) -> None:
        self.last_ok = now
        if self.table is not None and self.view.state in ("static", "fallback"):
            self.on_table(self.table, self.etag, now)

    def on_failure(self, now: float) -> None:
        self.poll_failures += 1
        if self.view.state == "default" and self.last_ok is None:
            self._set(_restate(self.view, "never_reached"))
        elif self.view.state == "fresh":
            self._set(_restate(self.view, "static"))
        self.tick(now)

    def tick(self, now: float) -> None:
        """Fall back to equal weights once the last good poll is older than ``fail_static_s``."""
        if self.view.state not in ("fresh", "static", "advisory") or self.last_ok is None:
            return
        if now - self.last_ok > self.fail_static_s:
            self._set(config_view(self.settings, "fallback", self.view.version))
            self.etag = None  # the next good answer must be a full table
        elif (
            self.view.state == "fresh"
            and self.table is not None
            and self.share is not None
            and self.current_share(now) is None
        ):  # answers without a part for fail_static_s: the config's limits, divided
            self.share = None
            self._set(table_view(self.table, self.settings))

    def age(self, now: float) -> float | None:
        return None if self.last_ok is None else now - self.last_ok


def _restate(view: RoutingView, state: State) -> RoutingView:
    return RoutingView(state, view.version, view.prefill, view.decode, view.limits, view.avoid, view.never)


async def poll_once(
    state: RoutingState,
    client: httpx.AsyncClient,
    url: str,
    now: Callable[[], float],
    report: ProxyReport | None = None,
) -> bool:
    """One ``GET /v1/routing``; every outcome is fed to ``state`` (never raises httpx errors).
    True when the controller answered with a table or a 304."""
    headers = {"If-None-Match": state.etag} if state.etag else {}
    params = None if report is None else report.params()
    try:
        resp = await client.get(url, headers=headers, params=params)
    except httpx.HTTPError as exc:
        log.debug("routing poll of %s failed: %s", url, exc)
        state.on_failure(now())
        return False
    if resp.status_code == 304:
        state.on_not_modified(now())
        return True
    if resp.status_code in (401, 403, 409) and report is not None:
        state.on_refused(_detail(resp), now())
        return await poll_once(state, client, url, now)  # the table, weights and drains still apply
    if resp.status_code != 200:
        log.debug("routing poll of %s: HTTP %s", url, resp.status_code)
        state.on_failure(now())
        return False
    try:
        table = RoutingTable.model_validate_json(resp.content)
    except ValidationError as exc:
        log.warning("routing: controller %s sent an invalid table: %s", url, exc.errors()[:1])
        state.on_failure(now())
        return False
    state.on_table(table, resp.headers.get("etag"), now())
    return True


def _detail(resp: httpx.Response) -> str:
    try:
        detail = resp.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return str(detail)[:300] if detail else f"HTTP {resp.status_code}"


def report_auth(state: RoutingState, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The Authorization header of this proxy's reports: the token derived from the fleet's proxy
    secret and this proxy's id when the secret is set, else ``$proxy.controller_token_env``'s."""
    env = os.environ if environ is None else environ
    ps = state.settings.proxy
    secret = env.get(ps.controller_secret_env, "").strip()
    token = proxy_token(secret, state.proxy_id) if secret else env.get(ps.controller_token_env, "").strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


def quiet_httpx() -> None:
    """httpx logs every request at INFO: one line per poll. Unless someone set its level,
    keep it to warnings (the poller logs what changes itself)."""
    httpx_log = logging.getLogger("httpx")
    if httpx_log.level == logging.NOTSET:
        httpx_log.setLevel(logging.WARNING)


async def poll_forever(
    state: RoutingState,
    controller_urls: list[str],
    interval_s: float,
    now: Callable[[], float] = time.monotonic,
    report: Callable[[], ProxyReport] | None = None,
) -> None:
    """Poll until cancelled. Each request is bounded by a timeout below the interval. A failed
    poll moves on to the next of ``controller_urls`` at once (each replica serves the table);
    the one that answered is polled first next time. ``report`` is sent with every poll."""
    urls = [u.rstrip("/") + "/v1/routing" for u in controller_urls]
    at = 0
    quiet_httpx()
    timeout = httpx.Timeout(max(0.2, min(2.0, interval_s)))
    async with httpx.AsyncClient(timeout=timeout, headers=report_auth(state)) as client:
        while True:
            for i in range(len(urls)):
                url = urls[(at + i) % len(urls)]
                try:
                    ok = await poll_once(state, client, url, now, None if report is None else report())
                except Exception:  # a bug here must not stop routing updates, nor traffic
                    log.exception("routing poll raised; counted as a failed poll")
                    state.on_failure(now())
                    ok = False
                if ok:
                    if i:
                        log.info("routing: now polling %s", url)
                    at = (at + i) % len(urls)
                    break
            await asyncio.sleep(interval_s)
            state.tick(now())
