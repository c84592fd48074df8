"""Stale peers after a restart: a P×D pair left out of routing until it is served again.

When a P restarts, a D may keep its NIXL agent for the old process (vLLM and NIXL users report
it where P's engine id is fixed) and fail every pull from the new one, for a long time, while
it serves every other P. Read as failures, that is a failing D; it is the pair's.

A pair is **stale** when its P has a confirmed restart (``InstanceSignals.restarted_at``: the
collector saw its process start time move *and* its counters reset; one signal alone confirms
nothing) and, of the handoffs P finished since then, the pair failed at least
``min_error_events`` and served none (``PairSignals.failed_since_restart``,
``served_since_restart``). A stale pair stays stale, tick after tick, until a handoff through it
is served after its P's restart (a proxy's probe, or a request that had nowhere else to go), or
its P or D leaves the fleet, or its P restarts again (then it is judged afresh). Served again,
it is back in routing, but for one window more its failures (still in the window) are the
stale agent's, not the D's. Only the pairs still stale go in the routing table's
``avoid_pairs`` (:func:`avoided`). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from controller.policy.signals import InstanceSignals, Observation, PairSignals


def pair_key(p: str, d: str) -> str:
    return f"{p}->{d}"


@dataclass(frozen=True)
class StalePair:
    """A pair left out of routing: since when (the tick that found it), the P's restart it followed,
    and its failures since that restart in the window."""

    p_instance: str
    d_instance: str
    since: float
    restarted_at: float
    failed: int
    # when a handoff through it was served again (then it is back in routing, and for one window its
    # failures in the window are still the stale agent's, not the D's); None: still stale
    healed_at: float | None = None

    @property
    def text(self) -> str:
        return (
            f"{self.d_instance} failed {self.failed} handoff(s) from {self.p_instance} since "
            f"{self.p_instance} restarted and was served none: its agent for {self.p_instance} is stale"
        )


def _stale_now(pair: PairSignals, p: InstanceSignals | None, min_failures: int) -> bool:
    return (
        p is not None
        and p.restarted_at is not None
        and pair.served_since_restart == 0
        and pair.failed_since_restart >= min_failures
    )


def stale_pairs(obs: Observation, prev: Mapping[str, StalePair], min_failures: int) -> dict[str, StalePair]:
    """The stale pairs now (by :func:`pair_key`), from the observation and the last tick's."""
    names = {i.name: i for i in obs.instances}
    pairs = {pair_key(x.p_instance, x.d_instance): x for x in obs.pairs}
    out: dict[str, StalePair] = {}
    for key, old in prev.items():
        p, seen = names.get(old.p_instance), pairs.get(key)
        if p is None or old.d_instance not in names or p.restarted_at != old.restarted_at:
            continue  # gone from the fleet, or restarted again: judged afresh below
        if old.healed_at is not None:
            if obs.now - old.healed_at < obs.window_s:
                out[key] = old  # back in routing; its failures still in the window stay the pair's
            continue
        if seen is not None and seen.served_since_restart > 0:
            out[key] = replace(old, healed_at=obs.now)  # served again: the D's agent is fresh
            continue
        failed = seen.failed_since_restart if seen is not None else old.failed
        out[key] = replace(old, failed=max(failed, old.failed))
    for key, x in pairs.items():
        p = names.get(x.p_instance)
        if key not in out and _stale_now(x, p, min_failures) and p is not None and p.restarted_at is not None:
            out[key] = StalePair(x.p_instance, x.d_instance, obs.now, p.restarted_at, x.failed_since_restart)
    return out


def avoided(stale: Mapping[str, StalePair]) -> list[StalePair]:
    """The pairs to leave out of routing: the stale ones not yet served again."""
    return [sp for sp in stale.values() if sp.healed_at is None]


def _fresh(p: InstanceSignals, fresh_since: float) -> bool:
    """A P down now (D's pulls of the handoffs it had finished fail), or restarted within the window
    (``fresh_since``: on the records' clock, :func:`_records_clock`)."""
    return p.up is False or (p.restarted_at is not None and p.restarted_at >= fresh_since)


def _records_clock(obs: Observation) -> float:
    """``now`` on the records' clock: the newest record's arrival (``records_until``), within the window,
    or ``now`` without records. A restart is fresh for a window on this clock, not the wall's: the
    records of the handoffs it failed at a D come after D's counter, by the collector's lag, and on a
    busy machine (thousands of failed records from P's outage to assemble) that lag can outlast the
    window, when D's counter alone would be charged to it: the likeliest reading of a D cut after a
    P's restart in a real-vLLM CI run of stop 46."""
    until = obs.records_until
    return obs.now if until is None else min(obs.now, max(until, obs.now - obs.window_s))


def _suspect(x: PairSignals, p: InstanceSignals | None, fresh_since: float) -> bool:
    """A pair into a P down now, or restarted within the window and serving nothing through it since."""
    return p is not None and _fresh(p, fresh_since) and (p.up is False or x.served_since_restart == 0)


def _keep(
    d: InstanceSignals,
    failing: list[PairSignals],
    theirs_of: Mapping[str, bool],
    fresh: list[str],
) -> tuple[float, str]:
    """The share of D's failures that stay its own, and why the rest do not: those on its ``failing`` pairs
    that ``theirs_of`` marks (stale pairs, and pairs into a P down now or restarted within the window, not
    yet enough to call stale); and, while a P is ``fresh`` (down or restarted within the window) and the
    records name no failure of D's toward any P yet, all of them (the records of the failed handoffs come
    after vLLM's counter). A D that fails on its own just then is judged a window later."""
    mine = sum(x.failures for x in failing)
    if mine:
        toward = sorted({x.p_instance for x in failing if theirs_of[pair_key(x.p_instance, x.d_instance)]})
        theirs = sum(x.failures for x in failing if theirs_of[pair_key(x.p_instance, x.d_instance)])
        if not theirs:
            return 1.0, ""
        return (
            1.0 - theirs / mine,
            f"{theirs} of its {mine} failed handoffs are toward {', '.join(toward)}, down or restarted",
        )
    if fresh and (d.failed_requests or d.failed_transfers_per_min or d.lease_expiry_suspects):
        return (
            0.0,
            f"{', '.join(fresh)}: down or restarted within the window, no record names its failures' P yet",
        )
    return 1.0, ""


def relieve_stale(obs: Observation, stale: Mapping[str, StalePair]) -> tuple[Observation, dict[str, str]]:
    """Each D relieved of the failures its stale pairs brought it (they are the pairs', not the D's), and
    of those a P's fresh restart or outage may explain (:func:`_keep`): the observation with those moved,
    and per D relieved, what was moved (its decision's ``inputs.stale_peer_basis``). One pass over the
    pairs, grouped by D."""
    fresh_since = _records_clock(obs) - obs.window_s
    fresh = sorted(i.name for i in obs.instances if i.role == "prefill" and _fresh(i, fresh_since))
    if not stale and not fresh:
        return obs, {}
    names = {i.name: i for i in obs.instances}
    failing: dict[str, list[PairSignals]] = {}
    theirs_of: dict[str, bool] = {}
    for x in obs.pairs:
        if x.failures:
            key = pair_key(x.p_instance, x.d_instance)
            failing.setdefault(x.d_instance, []).append(x)
            theirs_of[key] = key in stale or _suspect(x, names.get(x.p_instance), fresh_since)
    basis: dict[str, str] = {}
    moved: list[InstanceSignals] = []
    for inst in obs.instances:
        keep, why = (
            (1.0, "") if inst.role != "decode" else _keep(inst, failing.get(inst.name, []), theirs_of, fresh)
        )
        if keep >= 1.0:
            moved.append(inst)
            continue
        moved.append(
            replace(
                inst,
                failed_requests=round(inst.failed_requests * keep),
                failed_transfers_per_min=inst.failed_transfers_per_min * keep,
                lease_expiry_suspects=round(inst.lease_expiry_suspects * keep),
            )
        )
        basis[inst.name] = f"{why}: not charged to it (StalePeerAfterRestart)"
    pairs = tuple(
        replace(x, failures=0) if pair_key(x.p_instance, x.d_instance) in stale else x for x in obs.pairs
    )
    return replace(obs, instances=tuple(moved), pairs=pairs), basis
