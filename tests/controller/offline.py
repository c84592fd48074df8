"""Replay the controller's policy over a stored run: observe the store at each tick time, decide.

With nothing cut, a live controller's routing equals the static one the run was served with, so an
offline replay of a healthy run is what the controller would have decided live.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from controller.observe import observe
from controller.policy import (
    AlertConfig,
    InstanceSpec,
    Observation,
    PolicyConfig,
    PolicyState,
    PoolSpec,
    TickInput,
    TickOutput,
    decide,
    default_rules,
)
from pdscope.config import Settings
from store.db import transaction


@dataclass(frozen=True)
class Tick:
    obs: Observation
    out: TickOutput


def specs(settings: Settings) -> tuple[tuple[InstanceSpec, ...], tuple[PoolSpec, ...]]:
    insts = tuple(
        InstanceSpec(i.name, pool, settings.pools[pool].role, i.url) for pool, i in settings.instances()
    )
    pools = tuple(PoolSpec(name, p.role, 1.0) for name, p in settings.pools.items())
    return insts, pools


def decide_all(observations: list[Observation], settings: Settings) -> Iterator[TickOutput]:
    cfg, ac = PolicyConfig.from_settings(settings), AlertConfig()
    insts, pools = specs(settings)
    state = PolicyState()
    for obs in observations:
        out = decide(TickInput(obs, state, (), insts, pools, "enforce"), cfg, default_rules(ac), ac)
        state = out.state
        yield out


def replay_store(settings: Settings, factory: sessionmaker[Session], start: float, end: float) -> list[Tick]:
    step = settings.controller.interval_s
    times = [start + k * step for k in range(int((end - start) / step) + 1)]
    observations = []
    for now in times:
        with transaction(factory) as s:
            observations.append(observe(s, settings, now))
    return [Tick(o, out) for o, out in zip(observations, decide_all(observations, settings), strict=True)]


def cuts(ticks: list[Tick], below: float = 0.9) -> list[str]:
    """Every weight under ``below`` and every cut of a pool's request limit, as readable lines."""
    out: list[str] = []
    for k, t in enumerate(ticks):
        for d in t.out.weights:
            if d.weight < below:
                out.append(f"tick {k}: {d.instance} weight {d.weight:.2f} {d.reason}: {d.message}")
        for p in t.out.pools:
            if p.old is not None and p.new.max_inflight_requests < p.old.max_inflight_requests:
                out.append(
                    f"tick {k}: {p.pool} limit {p.old.max_inflight_requests} -> "
                    f"{p.new.max_inflight_requests} {p.reason}: {p.message}"
                )
    return out


# -- fixtures: observations and the decisions they gave, as compact JSON ------------------------------


def _compact(value: object) -> object:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _compact(v) for k, v in value.items() if v is not None and v != 0 and v != 0.0}
    if isinstance(value, list | tuple):
        return [_compact(v) for v in value]
    return value


_TIMES = ("now", "newest_data")
_KEYS = ("name", "pool", "role")


def obs_to_json(obs: Observation, t0: float) -> dict[str, object]:
    """An observation as compact JSON: times relative to ``t0``, instances keyed by name, no pairs
    (the policy does not read them), zeros and unknowns left out."""
    from dataclasses import asdict

    insts: dict[str, object] = {}
    for i in obs.instances:
        d = asdict(i)
        for k in _KEYS:
            d.pop(k)
        if d.get("last_seen") is not None:
            d["last_seen"] -= t0
        insts[i.name] = _compact(d)
    out: dict[str, object] = {
        k: (getattr(obs, k) - t0 if getattr(obs, k) is not None else None) for k in _TIMES
    }
    out.update(
        window_s=obs.window_s,
        history_s=obs.history_s,
        untrusted_records=obs.untrusted_records,
        unattributed_lease_expiries=obs.unattributed_lease_expiries,
        instances=insts,
        pools=[asdict(p) for p in obs.pools],
        slo=asdict(obs.slo),
    )
    return {k: _compact(v) for k, v in out.items() if v is not None}


def obs_from_json(d: dict[str, Any], t0: float, members: dict[str, tuple[str, str]]) -> Observation:
    """The inverse of :func:`obs_to_json`; ``members`` maps an instance to its (pool, role)."""
    from controller.policy import InstanceSignals, PoolSignals, SLOFigures

    insts = []
    for name, (pool, role) in members.items():
        f = dict(d["instances"].get(name, {}))
        if "last_seen" in f:
            f["last_seen"] += t0
        insts.append(InstanceSignals(name=name, pool=pool, role=role, **f))  # type: ignore[arg-type]
    return Observation(
        now=d.get("now", 0.0) + t0,
        window_s=d["window_s"],
        instances=tuple(insts),
        pools=tuple(PoolSignals(**p) for p in d.get("pools", [])),
        slo=SLOFigures(**d["slo"]),
        newest_data=d["newest_data"] + t0 if "newest_data" in d else None,
        untrusted_records=d.get("untrusted_records", 0),
        history_s=d.get("history_s", 0.0),
        unattributed_lease_expiries=d.get("unattributed_lease_expiries", 0),
    )


def decisions_of(out: TickOutput) -> dict[str, object]:
    return {
        "weights": {d.instance: d.weight for d in out.weights},
        "reasons": {d.instance: d.reason for d in out.weights},
        "limits": {p.pool: p.new.max_inflight_requests for p in out.pools},
        "limit_reasons": {p.pool: p.reason for p in out.pools},
    }
