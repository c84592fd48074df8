"""Pool admission limits: how many requests and handoff KV bytes a pool may hold in flight.

The proxy enforces these before P (see docs/proxy.md, Admission);
here they are computed from four pressures, each a factor in [0, 1]:

* ``kv``      the pool's mean KV usage (on P it includes blocks leased to D); 1 up to
              ``kv_admit_full``, 0 at ``kv_admit_zero``.
* ``backlog`` D pools: requests waiting at D between P done and D first token (the KV-fetch
              gauges' ``waiting_to_start`` and ``completed_waiting``), as seconds of work at the
              pool's completion rate, against the handoff budget. A pull in progress is not D's
              queue but the link's time: a P whose NIC slowed tenfold filled that stage on every D
              and cut the decode pool's limit from 256 to 9, where the predictor weighs each pair's
              handoff itself.
* ``ttft``    P pools (where requests enter; a D pool is not cut for a slow P): the SLO
              percentile of TTFT through the pool against the target.
* ``queue``   P pools: the wait in P's own queues now (the lower median member's requests
              waiting at the latest scrape x members ÷ the pool's completion rate) against the
              TTFT budget the fleet leaves for that queue: target minus the SLO percentile of
              TTFT without the admission wait and without the request's time in P's queue (so
              the window's queue is not counted twice against the queue of now; where P's spans
              carry no queue time, without the admission wait only), at least 10 % of the
              target. The fastest of the four: the gauges are a scrape old, where TTFT needs
              requests to finish first.

``pressure = min(factors)``. Under ``cut_below`` (at once when at most ``limit_cut_floor``,
else on the second tick in a row, so one noisy scrape cuts nothing) the request limit is cut
to what is in flight now times the pressure, plus twice its square root as headroom for
Poisson bursts (never by more than half per cut, then a cooldown so a cut can show in the
window before the next). In flight is the larger of Little's law over the window and, for P
pools, what P's gauges hold now (running + waiting). When P's queue is the worst pressure the
cut is a level, not a ratio: the limit becomes what is in flight minus the part of P's queue
that does not fit the TTFT budget left (``waiting - budget x completion rate``), with no
cooldown, because the gauges show its effect at the next scrape. Above
``grow_above`` for ``recover_ticks`` ticks in a row it grows additively back to the
configured default (AIMD), one step per ``recover_ticks`` calm ticks, or in one step once the
limit holds twice what is in flight plus twice its square root (it binds nothing); in between it
holds (a band, so mild noise moves nothing). The KV-bytes limit of a pool is the configured budget
scaled by the ``kv`` factor (never below ``min_kv_bytes_fraction`` of it).

A request that finds its pools full waits in the proxy for a slot, and that wait is part of
its TTFT. So each pool also gets ``max_queue_wait_s``: the TTFT target minus the SLO
percentile of what the fleet itself takes (TTFT without the admission wait), never more
than the proxy's configured queue timeout. When the fleet alone uses the whole budget, a
request that cannot be admitted at once is rejected at once rather than served late.
The measured budget is noisy (one slow request holds the window's percentile for a whole
window), so the published one moves only past a dead band (``wait_band`` of the target) that
the measure held on every tick for a window and one tick (``wait_confirm_windows``), to the
value of that run nearest the published one; a tick that cuts the request limit (pressure that
is real) lowers it at once.
**With admission by prediction** (``proxies_predict``: pdscope's proxies hold each request's
predicted TTFT against its target, ``proxy.predict.admit``), the latency pressures (``ttft``,
``queue``) are the predictor's to act on: it sees P's backlog in tokens and its own error per
request, where a pool limit cut on the window's percentile rejects what would have made it, and a
published wait budget cuts short a wait the prediction says is in time. So they are computed and
explained, but they cut nothing and no wait budget is published; the limits stay a hard ceiling
for what the predictor cannot see (``kv``: D's KV blocks; ``backlog``: handoffs piling up at D), and
the controller's rates (``controller.rates``) are the predictor's prior.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from controller.policy.config import PolicyConfig
from controller.policy.signals import Observation, PoolSignals, Role
from pdscope.reasons import Reason

PRESSURE_REASONS = {
    "kv": Reason.KV_HEADROOM_LOW,
    "backlog": Reason.HANDOFF_BACKLOG,
    "ttft": Reason.TTFT_OVER_BUDGET,
    "queue": Reason.PREFILL_QUEUEING,
}
LATENCY_PRESSURES = ("ttft", "queue")  # what the proxies' predictor acts on, with admission by prediction


@dataclass(frozen=True)
class LimitState:
    max_inflight_requests: int
    max_inflight_kv_bytes: int
    cooldown: int = 0
    max_queue_wait_s: float | None = None  # None: the proxy's configured queue timeout
    pressured: int = 0  # consecutive ticks of mild pressure (a mild one cuts on the second)
    calm: int = 0  # consecutive ticks without pressure (a cut limit grows back after recover_ticks)
    # consecutive ticks the measured wait budget sat past the dead band: > 0 above the published one, < 0
    # below; and the value of that run nearest the published one (where it moves once confirmed)
    wait_streak: int = 0
    wait_seen: float | None = None


@dataclass(frozen=True)
class PoolDecision:
    pool: str
    role: Role
    old: LimitState | None
    new: LimitState
    reason: Reason
    message: str
    arithmetic: str
    scores: Mapping[str, float] = field(default_factory=dict)
    inputs: Mapping[str, Any] = field(default_factory=dict)

    def changed(self, name: str) -> bool:
        old = None if self.old is None else getattr(self.old, name)
        return bool(old != getattr(self.new, name))


def pressure_factors(pool: PoolSignals, cfg: PolicyConfig) -> dict[str, float]:
    f: dict[str, float] = {}
    if pool.kv_usage is not None:
        span = cfg.kv_admit_zero - cfg.kv_admit_full
        f["kv"] = min(1.0, max(0.0, (cfg.kv_admit_zero - pool.kv_usage) / span))
    if pool.role == "decode" and pool.handoff_backlog_requests and pool.completed_per_s:
        wait_s = pool.handoff_backlog_requests / pool.completed_per_s
        f["backlog"] = min(1.0, cfg.handoff_budget_s / wait_s) if wait_s > 0 else 1.0
    if pool.role == "prefill" and pool.ttft_at_slo_s is not None and pool.ttft_at_slo_s > 0:
        f["ttft"] = min(1.0, cfg.ttft_target_s / pool.ttft_at_slo_s)
    queue_s = prefill_queue_s(pool)
    if queue_s is not None and queue_s > 0:
        f["queue"] = min(1.0, ttft_left_s(pool, cfg) / queue_s)
    return f


def prefill_queue_s(pool: PoolSignals) -> float | None:
    """P pools: how long a request joining P's queues now waits there (waiting ÷ completion rate)."""
    if pool.role != "prefill" or pool.waiting_now is None or not pool.completed_per_s:
        return None
    return pool.waiting_now / pool.completed_per_s


def ttft_left_s(pool: PoolSignals, cfg: PolicyConfig) -> float:
    """The TTFT budget the fleet leaves for P's queue: target minus what a request takes besides that
    queue (at least 10% of the target). Where P's spans carry no queue time, minus the whole service
    TTFT, which counts the window's queue against the queue of now as well (stricter)."""
    taken = next((v for v in (pool.unqueued_ttft_at_slo_s, pool.service_ttft_at_slo_s) if v is not None), 0.0)
    return max(cfg.queue_budget_floor * cfg.ttft_target_s, cfg.ttft_target_s - taken)


def _drain_queue(pool: PoolSignals, req: int, inflight: float | None, cfg: PolicyConfig) -> tuple[int, str]:
    """The limit that keeps P's queue within the TTFT budget left: in flight minus the excess queue."""
    waiting = pool.waiting_now or 0.0
    rate = pool.completed_per_s or 0.0
    left = ttft_left_s(pool, cfg)
    held = inflight if inflight is not None else float(req)
    new_req = max(cfg.min_inflight_requests, math.floor(held - max(0.0, waiting - left * rate)))
    return new_req, (
        f"requests = max({cfg.min_inflight_requests}, floor(in flight {held:.1f} - (waiting {waiting:.1f}"
        f" - budget left {left:.2f}s × {rate:.1f}/s))) = {new_req}"
    )


def _inflight(pool: PoolSignals) -> float | None:
    """Requests the pool holds: Little's law over the window, or P's gauges now if more."""
    gauges = None
    if pool.role == "prefill" and pool.running_now is not None:
        gauges = pool.running_now + (pool.waiting_now or 0.0)
    values = [v for v in (pool.inflight_requests, gauges) if v is not None]
    return max(values) if values else None


def measured_wait(pool: PoolSignals, cfg: PolicyConfig) -> tuple[float | None, str]:
    """``(budget, arithmetic)``: the TTFT budget a request has left to wait for a slot, this tick
    (``wait_step_s`` steps; None: too few requests to measure)."""
    if pool.service_ttft_at_slo_s is None:
        return None, "too few requests to measure"
    left = cfg.ttft_target_s - pool.service_ttft_at_slo_s
    wait = round(max(0.0, math.floor(left / cfg.wait_step_s) * cfg.wait_step_s), 3)
    return wait, (
        f"max(0, TTFT target {cfg.ttft_target_s:g}s - p{cfg.ttft_percentile:g} TTFT without admission "
        f"{pool.service_ttft_at_slo_s:.2f}s) = {wait:.2f}s"
    )


@dataclass(frozen=True)
class Wait:
    """The published wait budget (None: the proxy's own timeout) and its dead-band streak."""

    value: float | None
    streak: int
    seen: float | None
    arith: str


def _published(wait: float, cfg: PolicyConfig) -> float | None:
    """The proxy's own timeout is the shorter: leave it to the proxy."""
    return None if wait >= cfg.default_queue_wait_s else wait


def queue_wait(pool: PoolSignals, base: LimitState, cfg: PolicyConfig, cut: bool = False) -> Wait:
    """``max_queue_wait_s`` with its dead band: it moves to what was measured only when that sat at least
    ``wait_band`` x the target away, on the same side, on every tick for ``wait_confirm_ticks`` (then to
    the run's value nearest the published one), or at once downwards on a tick that cuts the request
    limit (``cut``)."""
    prev = base.max_queue_wait_s
    shown = "default" if prev is None else f"{prev:.2f}s"
    wait, text = measured_wait(pool, cfg)
    if wait is None:
        return Wait(prev, base.wait_streak, base.wait_seen, f"wait = {shown} ({text}; held)")
    cur = cfg.default_queue_wait_s if prev is None else prev
    if cut and wait < cur:
        return Wait(_published(wait, cfg), 0, None, f"wait = {text} (the request limit is cut: at once)")
    band = cfg.wait_band * cfg.ttft_target_s
    side = -1 if wait <= cur - band else 1 if prev is not None and wait >= cur + band else 0
    if side == 0:
        return Wait(prev, 0, None, f"wait = {shown} (measured {text}: within ±{band:.2f}s, held)")
    if base.wait_streak * side > 0 and base.wait_seen is not None:
        streak, nearest = base.wait_streak + side, max if side < 0 else min
        seen = nearest(base.wait_seen, wait)
    else:
        streak, seen = side, wait
    need = cfg.wait_confirm_ticks
    if abs(streak) < need:
        return Wait(
            prev,
            streak,
            seen,
            f"wait = {shown} (measured {text}: {'below' if side < 0 else 'above'} by ±{band:.2f}s or more, "
            f"{abs(streak)}/{need} ticks)",
        )
    return Wait(
        _published(seen, cfg),
        0,
        None,
        f"wait = {seen:.2f}s (nearest of {need} ticks in a row past ±{band:.2f}s of {shown}; now {text})"
        + (
            f" >= queue_timeout_s {cfg.default_queue_wait_s:g}s: the proxy's default"
            if _published(seen, cfg) is None
            else ""
        ),
    )


@dataclass(frozen=True)
class _Tick:
    """One pool's inputs to its request limit this tick."""

    pool: PoolSignals
    base: LimitState
    cfg: PolicyConfig
    factors: dict[str, float]
    pressure: float
    inflight: float | None

    @property
    def worst(self) -> str:
        """The factor with the most pressure (raises where there is none: asked only under pressure)."""
        return min(self.factors, key=lambda k: self.factors[k])

    @property
    def cooldown(self) -> int:
        return max(0, self.base.cooldown - 1)

    @property
    def pressured(self) -> int:
        return self.base.pressured + 1 if self.pressure < self.cfg.cut_below else 0


@dataclass(frozen=True)
class _Limit:
    """What one step decides for the request limit, and why."""

    req: int
    reason: Reason
    message: str
    arith: str
    cooldown: int
    pressured: int
    calm: int = 0


def _warming(t: _Tick) -> _Limit:
    """The start-up window: pressure (other than KV) is not acted on."""
    req, worst, name = t.base.max_inflight_requests, t.worst, t.pool.name
    return _Limit(
        req,
        Reason.WARMING_UP,
        f"{name}: start-up window; {worst} pressure {t.pressure:.2f} not acted on",
        f"requests = {req} (start-up window: {worst} pressure {t.pressure:.2f} not acted on)",
        t.cooldown,
        0,
    )


def _waiting(t: _Tick, worst: str, what: str, detail: str) -> _Limit:
    """The request limit kept under ``worst`` pressure while a cut waits: ``what`` it waits for in the
    message, ``detail`` in the arithmetic."""
    req = t.base.max_inflight_requests
    return _Limit(
        req,
        PRESSURE_REASONS[worst],
        f"{t.pool.name}: {worst} pressure {t.pressure:.2f}; {what}",
        f"requests = {req} ({detail})",
        t.cooldown,
        t.pressured,
    )


def _confirm_queue(t: _Tick) -> _Limit:
    """One scrape's queue is a sample of a bursty process: a level cut needs it on consecutive ticks."""
    detail = f"P queue pressure {t.pressure:.2f}: confirming, {t.pressured}/{t.cfg.queue_confirm_ticks} ticks"
    return _waiting(t, "queue", "confirming before a cut", detail)


def _queue_cut(t: _Tick) -> _Limit:
    """P's queue is the worst pressure: a level cut to what fits the TTFT budget left, no cooldown."""
    old = t.base.max_inflight_requests
    new_req, text = _drain_queue(t.pool, old, t.inflight, t.cfg)
    req = min(old, new_req)
    message = f"{t.pool.name}: P queue over the TTFT budget left; request limit {old} -> {req}"
    return _Limit(req, PRESSURE_REASONS["queue"], message, text, t.cooldown, t.pressured)


def _cooling(t: _Tick) -> _Limit:
    detail = f"cooldown {t.cooldown} ticks after the last cut"
    return _waiting(t, t.worst, "waiting for the last cut to show", detail)


def _confirm(t: _Tick) -> _Limit:
    detail = f"pressure {t.pressure:.2f}: confirming, {t.pressured}/2 ticks"
    return _waiting(t, t.worst, "confirming before a cut", detail)


def _gradient_cut(t: _Tick) -> _Limit:
    """What is in flight, scaled by the pressure, plus 2 sqrt(basis) of headroom for bursts."""
    cfg, old, inflight, worst = t.cfg, t.base.max_inflight_requests, t.inflight, t.worst
    cut = max(cfg.limit_cut_floor, t.pressure)
    basis = min(old, math.ceil(inflight)) if inflight is not None else old
    new_req = max(cfg.min_inflight_requests, math.floor(basis * cut + 2 * math.sqrt(basis)))
    arith = (
        f"requests = max({cfg.min_inflight_requests}, floor(b × max({cfg.limit_cut_floor}, "
        f"{t.pressure:.2f}) + 2 sqrt(b))) = {new_req} with b = min(limit {old}, in flight "
        f"{'?' if inflight is None else math.ceil(inflight)})"
    )
    cooldown = cfg.limit_cut_cooldown_ticks if new_req < old else t.cooldown
    req = min(old, new_req)
    message = f"{t.pool.name}: {worst} pressure {t.pressure:.2f}; request limit {old} -> {req}"
    return _Limit(req, PRESSURE_REASONS[worst], message, arith, cooldown, t.pressured)


def _under_pressure(t: _Tick) -> _Limit:
    """Pressure under ``cut_below``: cut, or confirm first, or wait out the last cut's cooldown."""
    if t.worst == "queue":
        return _confirm_queue(t) if t.pressured < t.cfg.queue_confirm_ticks else _queue_cut(t)
    if t.cooldown > 0:
        return _cooling(t)
    if t.pressure > t.cfg.limit_cut_floor and t.pressured < 2:
        return _confirm(t)
    return _gradient_cut(t)


def _hold(t: _Tick) -> _Limit:
    """Mild pressure, between ``cut_below`` and ``grow_above``: the band in which nothing moves."""
    req, cfg = t.base.max_inflight_requests, t.cfg
    return _Limit(
        req,
        Reason.HOLDING,
        f"{t.pool.name}: mild {t.worst} pressure {t.pressure:.2f}; request limit held at {req}",
        f"requests = {req} (pressure {t.pressure:.2f} between {cfg.cut_below} and {cfg.grow_above}: hold)",
        t.cooldown,
        t.pressured,
    )


def _calm(t: _Tick) -> _Limit:
    """No pressure: a cut limit grows back additively after ``recover_ticks`` calm ticks (AIMD)."""
    req, cfg, name = t.base.max_inflight_requests, t.cfg, t.pool.name
    default_req, calm = cfg.default_max_inflight_requests, t.base.calm + 1
    if req >= default_req:
        return _Limit(
            req, Reason.HEALTHY, f"{name}: no pressure", f"requests = {req} (default)", t.cooldown, 0, calm
        )
    if calm < cfg.recover_ticks:
        return _Limit(
            req,
            Reason.HOLDING_FOR_HYSTERESIS,
            f"{name}: no pressure for {calm} ticks; limit held at {req}",
            f"requests = {req} (calm {calm}/{cfg.recover_ticks} ticks before growing)",
            t.cooldown,
            0,
            calm,
        )
    home = _home(t, req, default_req, calm)
    if home is not None:
        return home
    # one step per recover_ticks calm ticks (the count starts again): each step a decision worth reading
    step = max(1, math.ceil(cfg.limit_increase * req))
    new_req = min(default_req, req + step)
    return _Limit(
        new_req,
        Reason.RECOVERING,
        f"{name}: no pressure for {calm} ticks; request limit {req} -> {new_req}",
        f"requests = min({default_req}, {req} + {step}) = {new_req}",
        t.cooldown,
        0,
        0,
    )


def _home(t: _Tick, req: int, default_req: int, calm: int) -> _Limit | None:
    """Calm, and the limit already holds twice what is in flight plus burst headroom: it binds nothing,
    so it goes back to the default in one decision, not a staircase of small ones."""
    if t.inflight is None:
        return None
    need = 2.0 * t.inflight + 2.0 * math.sqrt(max(t.inflight, 1.0))
    if req < need:
        return None
    return _Limit(
        default_req,
        Reason.RECOVERING,
        f"{t.pool.name}: no pressure for {calm} ticks and {t.inflight:.1f} in flight; request limit "
        f"{req} -> {default_req} (the default)",
        f"requests = {default_req} (limit {req} >= 2 x {t.inflight:.1f} in flight + 2 sqrt of it "
        f"= {need:.1f}: it binds nothing)",
        t.cooldown,
        0,
        0,
    )


def _request_limit(t: _Tick, warming: bool) -> _Limit:
    """The request limit: cut under pressure, held in the band, grown back when calm."""
    if t.pressure < t.cfg.cut_below:
        return _warming(t) if warming and t.worst != "kv" else _under_pressure(t)
    if t.pressure < t.cfg.grow_above:
        return _hold(t)
    return _calm(t)


def _kv_limit(factors: Mapping[str, float], cfg: PolicyConfig) -> tuple[int, str]:
    """The KV-bytes limit: the configured budget scaled by the ``kv`` factor, with a floor."""
    default_kv, kvf = cfg.default_max_inflight_kv_bytes, factors.get("kv", 1.0)
    kv_limit = round(default_kv * max(cfg.min_kv_bytes_fraction, kvf))
    return kv_limit, f"kv_bytes = {default_kv} × max({cfg.min_kv_bytes_fraction}, kv {kvf:.2f}) = {kv_limit}"


def _inputs(pool: PoolSignals, cfg: PolicyConfig, inflight: float | None) -> dict[str, Any]:
    return {
        "inflight_requests": inflight,
        "completed_per_s": pool.completed_per_s,
        "ttft_at_slo_s": pool.ttft_at_slo_s,
        "kv_usage": pool.kv_usage,
        "handoff_backlog_requests": pool.handoff_backlog_requests,
        "waiting_now": pool.waiting_now,
        "running_now": pool.running_now,
        "service_ttft_at_slo_s": pool.service_ttft_at_slo_s,
        "unqueued_ttft_at_slo_s": pool.unqueued_ttft_at_slo_s,
        "ttft_target_s": cfg.ttft_target_s,
        "handoff_budget_s": cfg.handoff_budget_s,
    }


def decide_pool(
    pool: PoolSignals, prev: LimitState | None, cfg: PolicyConfig, stale: bool, warming: bool = False
) -> PoolDecision:
    base = prev or LimitState(cfg.default_max_inflight_requests, cfg.default_max_inflight_kv_bytes)
    if stale:
        message = f"{pool.name}: collector behind; limits held"
        return PoolDecision(pool.name, pool.role, prev, base, Reason.STALE_DATA, message, "limits held")
    factors = pressure_factors(pool, cfg)
    acting = _acting(factors, cfg)
    pressure = min(acting.values(), default=1.0)
    inflight = _inflight(pool)
    limit = _request_limit(_Tick(pool, base, cfg, acting, pressure, inflight), warming)
    kv_limit, kv_arith = _kv_limit(factors, cfg)
    if cfg.proxies_predict:
        wait = Wait(None, 0, None, "wait = the proxy's: it waits while the request's prediction is in time")
    else:
        wait = queue_wait(pool, base, cfg, cut=limit.req < base.max_inflight_requests)
    message = limit.message
    if acting.keys() != factors.keys():
        message += "; TTFT and P's queue are left to the proxies' admission by prediction"
    if wait.value != base.max_queue_wait_s and wait.value is not None:
        message += f"; a request may wait {wait.value:.2f}s for a slot (the TTFT budget left)"
    new = LimitState(
        limit.req, kv_limit, limit.cooldown, wait.value, limit.pressured, limit.calm, wait.streak, wait.seen
    )
    return PoolDecision(
        pool=pool.name,
        role=pool.role,
        old=prev,
        new=new,
        reason=limit.reason,
        message=message,
        arithmetic="; ".join((limit.arith, kv_arith, wait.arith)),
        scores={k: round(v, 4) for k, v in factors.items()} | {"pressure": round(pressure, 4)},
        inputs=_inputs(pool, cfg, inflight),
    )


def _acting(factors: dict[str, float], cfg: PolicyConfig) -> dict[str, float]:
    """The factors that may move the request limit: with admission by prediction, not the latency ones."""
    if not cfg.proxies_predict:
        return factors
    return {k: v for k, v in factors.items() if k not in LATENCY_PRESSURES}


def decide_pools(
    obs: Observation, prev: Mapping[str, LimitState], cfg: PolicyConfig
) -> tuple[PoolDecision, ...]:
    age = obs.data_age_s
    stale = age is None or age > cfg.stale_after_s
    warming = obs.history_s is not None and obs.history_s < cfg.startup_s
    return tuple(
        replace(
            d, inputs={**d.inputs, "untrusted_records": obs.untrusted_records, "history_s": obs.history_s}
        )
        for d in (decide_pool(p, prev.get(p.name), cfg, stale, warming) for p in obs.pools)
    )
