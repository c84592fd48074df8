"""Pool admission limits: how many requests and handoff KV bytes a pool may hold in flight.

The proxy enforces these before P (backpressure points 1 and 3 in ARCHITECTURE.md);
here they are computed from three pressures, each a factor in [0, 1]:

* ``kv``      the pool's mean KV usage (on P it includes blocks leased to D); 1 up to
              ``kv_admit_full``, 0 at ``kv_admit_zero``.
* ``backlog`` D pools: requests between P done and D first token (the KV-fetch gauges),
              as seconds of work at the pool's completion rate, against the handoff budget.
* ``ttft``    the SLO percentile of TTFT through the pool against the target.

``pressure = min(factors)``. Under ``cut_below`` the request limit is cut to what is in
flight now times the pressure, plus sqrt of it as burst headroom (never by more than half
per cut, then a cooldown so a cut can show in the window before the next); above
``grow_above`` it grows additively back to the configured default (AIMD); in between it
holds (a band, so mild noise moves nothing). The KV-bytes limit of a pool is the configured budget
scaled by the ``kv`` factor (never below ``min_kv_bytes_fraction`` of it). Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from controller.policy.config import PolicyConfig
from controller.policy.signals import Observation, PoolSignals, Role

PRESSURE_REASONS = {"kv": "KVHeadroomLow", "backlog": "HandoffBacklog", "ttft": "TTFTOverBudget"}


@dataclass(frozen=True)
class LimitState:
    max_inflight_requests: int
    max_inflight_kv_bytes: int
    cooldown: int = 0


@dataclass(frozen=True)
class PoolDecision:
    pool: str
    role: Role
    old: LimitState | None
    new: LimitState
    reason: str
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
    if pool.ttft_p_s is not None and pool.ttft_p_s > 0:
        f["ttft"] = min(1.0, cfg.ttft_target_s / pool.ttft_p_s)
    return f


def decide_pool(
    pool: PoolSignals, prev: LimitState | None, cfg: PolicyConfig, stale: bool
) -> PoolDecision:
    default_req = cfg.default_max_inflight_requests
    default_kv = cfg.default_max_inflight_kv_bytes
    base = prev or LimitState(default_req, default_kv)
    if stale:
        return PoolDecision(pool.name, pool.role, prev, base, "StaleData",
                            f"{pool.name}: collector behind; limits held", "limits held")
    factors = pressure_factors(pool, cfg)
    pressure = min(factors.values(), default=1.0)
    cooldown = max(0, base.cooldown - 1)
    inflight = pool.inflight_requests
    arith: list[str] = []
    req = base.max_inflight_requests
    if pressure < cfg.cut_below:
        worst = min(factors, key=lambda k: factors[k])
        reason = PRESSURE_REASONS[worst]
        if cooldown > 0:
            arith.append(f"requests = {req} (cooldown {cooldown} ticks after the last cut)")
            message = f"{pool.name}: {worst} pressure {pressure:.2f}; waiting for the last cut to show"
        else:
            cut = max(cfg.limit_cut_floor, pressure)
            basis = min(req, math.ceil(inflight)) if inflight is not None else req
            # gradient: what is in flight, scaled by the pressure, plus sqrt(basis) of headroom for bursts
            new_req = max(cfg.min_inflight_requests, math.floor(basis * cut + math.sqrt(basis)))
            arith.append(f"requests = max({cfg.min_inflight_requests}, floor(b × max({cfg.limit_cut_floor}, "
                         f"{pressure:.2f}) + sqrt(b))) = {new_req} with b = min(limit {req}, in flight "
                         f"{'?' if inflight is None else math.ceil(inflight)})")
            if new_req < req:
                cooldown = cfg.limit_cut_cooldown_ticks
            req = min(req, new_req)
            message = f"{pool.name}: {worst} pressure {pressure:.2f}; request limit {base.max_inflight_requests}" \
                      f" -> {req}"
    elif pressure < cfg.grow_above:
        arith.append(f"requests = {req} (pressure {pressure:.2f} between {cfg.cut_below} and {cfg.grow_above}: hold)")
        worst = min(factors, key=lambda k: factors[k])
        reason, message = "Holding", f"{pool.name}: mild {worst} pressure {pressure:.2f}; request limit held at {req}"
    else:
        if req < default_req:
            step = max(1, math.ceil(cfg.limit_increase * req))
            new_req = min(default_req, req + step)
            arith.append(f"requests = min({default_req}, {req} + {step}) = {new_req}")
            reason, message = "Recovering", f"{pool.name}: no pressure; request limit {req} -> {new_req}"
            req = new_req
        else:
            arith.append(f"requests = {req} (default)")
            reason, message = "Healthy", f"{pool.name}: no pressure"
    kvf = factors.get("kv", 1.0)
    kv_limit = round(default_kv * max(cfg.min_kv_bytes_fraction, kvf))
    arith.append(f"kv_bytes = {default_kv} × max({cfg.min_kv_bytes_fraction}, kv {kvf:.2f}) = {kv_limit}")
    inputs: dict[str, Any] = {
        "inflight_requests": inflight, "completed_per_s": pool.completed_per_s, "ttft_p_s": pool.ttft_p_s,
        "kv_usage": pool.kv_usage, "handoff_backlog_requests": pool.handoff_backlog_requests,
        "ttft_target_s": cfg.ttft_target_s, "handoff_budget_s": cfg.handoff_budget_s,
    }
    return PoolDecision(
        pool=pool.name, role=pool.role, old=prev, new=LimitState(req, kv_limit, cooldown), reason=reason,
        message=message, arithmetic="; ".join(arith),
        scores={k: round(v, 4) for k, v in factors.items()} | {"pressure": round(pressure, 4)}, inputs=inputs,
    )


def decide_pools(
    obs: Observation, prev: Mapping[str, LimitState], cfg: PolicyConfig
) -> tuple[PoolDecision, ...]:
    age = obs.data_age_s
    stale = age is None or age > cfg.stale_after_s
    return tuple(decide_pool(p, prev.get(p.name), cfg, stale) for p in obs.pools)
