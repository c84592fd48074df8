"""From a window's raw aggregates to the signals the policy decides on.

``controller.observe`` reads the store (snapshots, request records, their handoff
percentiles) and hands the raw figures to this module, which decides what they say and
about whom. This is where the controller's robustness to one bad instance lives:

* **Charging.** Each request record is charged to the instances it went through: a request
  refused as invalid (a 4xx other than 429) to nobody (only counted); a failure to the stage
  that failed it (D once the decode stage began, else P; a 503 refusal is overload, like a
  429, and charged to no one); a retried record's failed attempts to the P or D that failed
  each; an expired lease to the D its handoff waited on (and counted on the P whose lease it
  was).
* **Little's law.** How long a request spends at an instance now: what it holds at the latest
  scrape ÷ what it finished per second over the last three scrapes (a stuck instance that
  finished nothing while holding work counts as half a completion: very slow, not unknown).
* **The typical member.** A pool's queue and handoff backlog are the lower median member's
  times the members, and its latency percentiles the lower median over the P×D pairs: one
  slow P or D (the weights' business) slows at most half the pairs and does not read as the
  whole pool being behind; overload slows every pair. Where no pair has enough samples (a
  large fleet, a short window), the pooled percentile.
* **Coverage.** Right after a start the window is not full: when its first record is more
  than ``coverage_start_fraction`` of the way in, rates are over the span the records cover.
* **Sample minimums** (``pair_min_samples``, ``pool_min_requests``): a figure from fewer
  samples is ``None``, which the policy reads as "not observed".

Pure: no I/O, no clock; every threshold is an :class:`EvidenceConfig` field.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median_low
from typing import Any, Protocol

from controller.policy.charges import (
    NOT_CHARGED_ERRORS,
    Charge,
    HandoffFacts,
    Pair,
    RecordFacts,
    after_restart,
    charge_of,
)
from controller.policy.config import EvidenceConfig
from controller.policy.signals import InstanceSignals, PoolSignals, Role
from pdscope.kvcompat import Identity
from pdscope.stats import percentile

UNPULLED_IDS = 5  # the newest unpulled handoffs a P's signals name


class ScrapeFigures(Protocol):
    """One instance's figures from its snapshots over a span (``store.queries.ScrapeFigures``)."""

    @property
    def up(self) -> bool: ...
    @property
    def last_ts(self) -> float: ...
    @property
    def seconds(self) -> float | None: ...
    @property
    def increases(self) -> Mapping[str, float]: ...
    @property
    def kv_cache_usage(self) -> float | None: ...
    @property
    def num_running(self) -> float | None: ...
    @property
    def num_waiting(self) -> float | None: ...
    @property
    def mean_ttft_s(self) -> float | None: ...
    @property
    def mean_nixl_xfer_s(self) -> float | None: ...
    @property
    def failed_transfers_per_min(self) -> float | None: ...
    @property
    def expired_leases_per_min(self) -> float | None: ...


class Percentiles(Protocol):
    """Handoff percentiles over the records through one instance or pair (``store.queries.HandoffStats``)."""

    @property
    def requests(self) -> int: ...
    @property
    def p50_s(self) -> float | None: ...
    @property
    def p99_s(self) -> float | None: ...


@dataclass(frozen=True)
class LatestGauges:
    """An instance's latest KV-fetch backlog (every stage), its mean queue time over the window, how
    long it has been down, the part of that backlog waiting at D rather than pulling (stages
    ``waiting_to_start`` and ``completed_waiting``), and its latest scrapes in a row that could not
    connect."""

    backlog: float | None
    queue_mean_s: float | None
    down_for_s: float | None
    waiting: float | None = None
    unreachable: int = 0
    # D: requests still to pull their KV from a P (stages ``waiting_to_start`` and ``in_progress``)
    pulling: float | None = None


@dataclass
class InstanceTally:
    contribution: list[float] = field(default_factory=list)
    handoff: list[float] = field(default_factory=list)
    requests: int = 0
    failed: int = 0
    refused: int = 0
    lease_charged: int = 0
    lease_on_p: int = 0  # P: lease expiries of this P the collector attributed to a waiting handoff
    # P: lease expiries of this P explained by a request D refused as the client's error (a 4xx but
    # 429): D never pulls such a handoff, so its lease must run out; evidence against nobody
    lease_refused: int = 0
    # P: the window's handoffs it prefilled that no D served (P done, no first token): each left its
    # blocks to a lease no D may ever pull; the newest few of their request ids name the suspects
    unpulled: int = 0
    unpulled_ids: list[str] = field(default_factory=list)

    def add_unpulled(self, request_id: str | None) -> None:
        self.unpulled += 1
        if request_id:
            self.unpulled_ids.append(request_id)
            del self.unpulled_ids[:-UNPULLED_IDS]


@dataclass
class PoolTally:
    role: Role
    residence: list[float] = field(default_factory=list)
    kv_bytes: list[float] = field(default_factory=list)
    service_ttft: list[float] = field(default_factory=list)
    unqueued_ttft: list[float] = field(default_factory=list)
    done: int = 0


class WindowTally:
    """The window's request records, charged record by record (:meth:`add`, or :meth:`apply` of a charge
    already worked out), in the order they are added."""

    def __init__(
        self, pools: Mapping[str, Role], now: float, restarted: Mapping[str, float] | None = None
    ) -> None:
        self.instances: defaultdict[str, InstanceTally] = defaultdict(InstanceTally)
        # P -> its latest confirmed restart (the new process's start): handoffs through it after that are
        # counted per pair, failed and served, to tell a D's stale agent for it from a failing D
        self.restarted: Mapping[str, float] = restarted or {}
        self.failed_since_restart: defaultdict[Pair, int] = defaultdict(int)
        self.served_since_restart: defaultdict[Pair, int] = defaultdict(int)
        self.pools = {name: PoolTally(role) for name, role in pools.items()}
        self.ttft_by_pair: defaultdict[Pair, list[float]] = defaultdict(list)
        self.service_by_pair: defaultdict[Pair, list[float]] = defaultdict(list)
        self.unqueued_by_pair: defaultdict[Pair, list[float]] = defaultdict(list)
        self.handoffs: list[float] = []
        self.charged_handoffs: list[HandoffFacts] = []
        # failed handoffs per P x D pair: failed decode attempts (the P whose blocks they were to pull) and
        # requests that failed once at D; what tells a P failing toward every D from a failing D
        self.pair_failures: defaultdict[Pair, int] = defaultdict(int)
        self.first_in = now
        # the newest record's arrival at the proxy: how far the stored records reach (None: no record)
        self.last_in: float | None = None

    def add(self, r: RecordFacts, invalid: bool) -> None:
        """Charge one record; ``invalid``: it was refused as invalid (``store.queries.is_client_error``)."""
        self.apply(charge_of(r, invalid))

    def apply(self, c: Charge) -> None:
        """Add one record's charges (:func:`controller.policy.charges.charge_of`)."""
        if c.t_in is not None and (self.last_in is None or c.t_in > self.last_in):
            self.last_in = c.t_in
        names = [inst for inst in (c.p, c.d) if inst is not None]
        if c.invalid:
            for inst in names:
                self.instances[inst].refused += 1
            return
        if c.handoff_facts is not None:
            self.charged_handoffs.append(c.handoff_facts)
        for inst in names:
            self.instances[inst].requests += 1
        self._outcome(c)
        self._times(c, names)

    def _outcome(self, c: Charge) -> None:
        pair = c.pair
        if c.failed_on is not None:
            self.instances[c.failed_on].failed += 1
        if pair is not None and c.served and after_restart(self.restarted, pair[0], c.p_done):
            self.served_since_restart[pair] += 1
        if pair is not None and c.pair_failed:
            self.pair_failures[pair] += 1
            if after_restart(self.restarted, pair[0], c.p_done):
                self.failed_since_restart[pair] += 1
        if c.unpulled and c.p is not None:
            self.instances[c.p].add_unpulled(c.request_id)

    def _times(self, c: Charge, names: list[str]) -> None:
        pair = c.pair
        if pair is not None and c.ttft_pair is not None:
            self.ttft_by_pair[pair].append(c.ttft_pair)
        if c.p is not None and c.p_contribution is not None:
            self.instances[c.p].contribution.append(c.p_contribution)
        if c.d is not None and c.d_contribution is not None:
            self.instances[c.d].contribution.append(c.d_contribution)
        if c.handoff is not None:
            self.handoffs.append(c.handoff)
            for inst in names:
                self.instances[inst].handoff.append(c.handoff)
        if c.t_in is not None:
            self._pool_times(c, c.t_in)

    def _pool_times(self, c: Charge, t_in: float) -> None:
        """TTFT without the admission wait (and without P's queue), and each pool's residence time."""
        pair = c.pair
        self.first_in = min(self.first_in, t_in)
        if pair is not None and c.service is not None:
            self.service_by_pair[pair].append(c.service)
        if pair is not None and c.unqueued is not None:
            self.unqueued_by_pair[pair].append(c.unqueued)
        for t in c.pools:
            agg = self.pools.get(t.pool)
            if agg is None:
                continue
            if c.service is not None:
                agg.service_ttft.append(c.service)
            if c.unqueued is not None:
                agg.unqueued_ttft.append(c.unqueued)
            if t.residence is None:
                continue
            agg.done += 1
            agg.residence.append(t.residence)
            if t.kv_bytes is not None:
                agg.kv_bytes.append(t.kv_bytes)

    def charge_failed_attempts(self, attempts: Iterable[object]) -> None:
        """Failed attempts a retried record does not show itself (``attributes["failed_attempts"]``):
        each charged to the P or D that failed it."""
        for a in attempts:
            if not isinstance(a, dict):
                continue
            inst, kind = a.get("instance"), a.get("kind")
            if isinstance(inst, str) and f"upstream_{kind}" not in NOT_CHARGED_ERRORS:
                self.instances[inst].failed += 1
                p_inst = a.get("p_instance") if a.get("stage") == "decode" else None
                if isinstance(p_inst, str):
                    self.pair_failures[p_inst, inst] += 1
                    if after_restart(self.restarted, p_inst, a.get("p_done")):
                        self.failed_since_restart[p_inst, inst] += 1

    def charge_lease_expiries(
        self,
        d_instance: object,
        ended_at: float | None,
        entries: object,
        since: float,
        until: float,
        invalid: bool = False,
    ) -> None:
        """A lease-expiry suspect: each attributed expiry (``attributes["lease_expiry"]``) counted in the
        window is charged to the D its handoff was sent to and counted on the P whose lease it was. A
        suspect without that detail is charged to its record's D when the record ended in the window.
        ``invalid``: the request ended as the client's error at D (``store.queries.is_client_error``):
        its expiries are explained on their P (``lease_refused``) and charged to nobody."""
        if invalid:
            self._explained(entries, since, until)
            return
        if not entries:
            if isinstance(d_instance, str) and ended_at is not None and since <= ended_at <= until:
                self.instances[d_instance].lease_charged += 1
            return
        for e in entries if isinstance(entries, list) else []:
            ts = e.get("to_ts") if isinstance(e, dict) else None
            if not isinstance(ts, int | float) or not since <= ts <= until:
                continue
            if isinstance(e.get("d_instance"), str):
                self.instances[e["d_instance"]].lease_charged += 1
            if isinstance(e.get("p_instance"), str):
                self.instances[e["p_instance"]].lease_on_p += 1
            if isinstance(e.get("p_instance"), str) and isinstance(e.get("d_instance"), str):
                self.pair_failures[e["p_instance"], e["d_instance"]] += 1  # a handoff that never arrived

    def _explained(self, entries: object, since: float, until: float) -> None:
        for e in entries if isinstance(entries, list) else []:
            ts = e.get("to_ts") if isinstance(e, dict) else None
            if isinstance(ts, int | float) and since <= ts <= until and isinstance(e.get("p_instance"), str):
                self.instances[e["p_instance"]].lease_refused += 1


def mean(values: Sequence[float]) -> float | None:
    """Their mean, summed exactly (``math.fsum``): the same to the bit in any order, so a window kept
    between ticks (``controller.policy.kepttally``) and one read whole agree."""
    return math.fsum(values) / len(values) if values else None


def rse(values: Sequence[float]) -> float | None:
    """Relative standard error of the mean of ``values`` (None for fewer than two, or a mean <= 0)."""
    if len(values) < 2:
        return None
    n = len(values)
    m = math.fsum(values) / n
    if m <= 0:
        return None
    # population standard deviation in floats (statistics.pstdev's exact fractions cost a tick
    # a third of a second at 1,000 instances), summed exactly as :func:`mean` is: order-free
    var = max(0.0, math.fsum((v - m) * (v - m) for v in values) / n)
    return math.sqrt(var) / (m * math.sqrt(n))


def finished(recent: ScrapeFigures | None, role: Role, handoff: str = "pull") -> float | None:
    """Requests (P: TTFTs) or handoffs (D: its NIXL transfers; in push mode, where P records them, its
    first tokens) finished over the last three scrapes."""
    if recent is None:
        return None
    pulls = role == "decode" and handoff == "pull"
    return recent.increases.get("nixl_xfer_time_count" if pulls else "ttft_count")


def load_now(role: Role, window: ScrapeFigures | None, latest: LatestGauges | None) -> float | None:
    """P: running + waiting at the latest scrape; D: the KV-fetch backlog at the latest scrape."""
    if role == "decode":
        return None if latest is None else latest.backlog
    if window is None or window.num_running is None or window.num_waiting is None:
        return None
    return window.num_running + window.num_waiting


def hold_time(
    load: float | None, recent: ScrapeFigures | None, role: Role, span_s: float, handoff: str = "pull"
) -> float | None:
    """Little's law: held now ÷ finished per second over the span the recent scrapes cover (else ``span_s``).

    Nothing finished while something is held counts as half a completion."""
    if load is None or recent is None:
        return None
    if load <= 0:
        return 0.0
    done = finished(recent, role, handoff)
    if done is None:
        return None
    return load / (max(done, 0.5) / (recent.seconds or span_s))


def typical_times_members(members: Sequence[InstanceSignals], attr: str) -> float | None:
    """The lower median over the up members of a gauge, times their number."""
    values = [float(v) for i in members if i.up and (v := getattr(i, attr)) is not None]
    return median_low(values) * len(values) if values else None


def sum_up(members: Sequence[InstanceSignals], attr: str) -> float | None:
    """A gauge summed over the up members at their latest scrape."""
    values = [float(v) for i in members if i.up and (v := getattr(i, attr)) is not None]
    return sum(values) if values else None


def per_pair(by_pair: Mapping[Pair, Sequence[float]], pct: float, n: int) -> dict[Pair, float]:
    """Each pair's percentile, of the pairs with ``n`` samples or more."""
    return {
        pair: v
        for pair, vals in by_pair.items()
        if len(vals) >= n and (v := percentile(vals, pct)) is not None
    }


def median_of_pairs(
    per: Mapping[Pair, float],
    side: int,
    members: set[str],
    pct: float,
    cfg: EvidenceConfig,
    pooled: Sequence[float] | None = None,
) -> float | None:
    """A pool's latency percentile: the lower median, over the P x D pairs through its up ``members``
    (``side`` 0: P, 1: D), of each pair's percentile (:func:`per_pair`: worked out once for every pool);
    where no pair has ``pair_min_samples``, the ``pooled`` percentile if given and as large."""
    through = sorted(v for pair, v in per.items() if pair[side] in members)
    if through:
        return median_low(through)
    if pooled is not None and len(pooled) >= cfg.pair_min_samples:
        return percentile(pooled, pct)
    return None


@dataclass(frozen=True)
class PairPercentiles:
    """Each P x D pair's TTFT, service TTFT and unqueued TTFT percentile (of those with ``pair_min_samples``),
    worked out once a tick for every pool's :func:`pool_signals` (each pair is through one P pool and one D
    pool: twice, before)."""

    ttft: Mapping[Pair, float]
    service: Mapping[Pair, float]
    unqueued: Mapping[Pair, float]

    @classmethod
    def of(cls, tally: WindowTally, cfg: EvidenceConfig) -> PairPercentiles:
        pct, n = cfg.ttft_percentile, cfg.pair_min_samples
        return cls(
            per_pair(tally.ttft_by_pair, pct, n),
            per_pair(tally.service_by_pair, pct, n),
            per_pair(tally.unqueued_by_pair, pct, n),
        )


def rate_span_s(window_s: float, since: float, first_in: float, now: float, cfg: EvidenceConfig) -> float:
    """The span completion rates are taken over: the window, or (when its first record is late in it, right
    after a start) the span the records cover, never under ``min_rate_span_s``."""
    if first_in - since <= window_s * cfg.coverage_start_fraction:
        return window_s
    return max(now - first_in, cfg.min_rate_span_s)


def instance_signals(
    name: str,
    pool: str,
    role: Role,
    cfg: EvidenceConfig,
    window: ScrapeFigures | None,
    recent: ScrapeFigures | None,
    latest: LatestGauges | None,
    tally: InstanceTally | None,
    handoff: Percentiles | None,
    restarted_at: float | None = None,
    identity: Identity | None = None,
) -> InstanceSignals:
    """An instance's signals from its scrapes (window, last three, latest gauges) and its charged records;
    its latest confirmed restart and its KV identity as given."""
    s, r, lt, rec = window, recent, latest, tally
    held = load_now(role, s, lt)
    return InstanceSignals(
        name=name,
        pool=pool,
        role=role,
        up=None if s is None else s.up,
        last_seen=None if s is None else s.last_ts,
        down_for_s=None if lt is None else lt.down_for_s,
        unreachable_scrapes=0 if lt is None else lt.unreachable,
        kv_usage=None if s is None else s.kv_cache_usage,
        num_running=None if s is None else s.num_running,
        num_waiting=None if s is None else s.num_waiting,
        **_pulls_at_d(role, lt),
        load_now=held,
        hold_time_now_s=hold_time(held, r, role, cfg.recent_s, cfg.handoff),
        ttft_mean_s=None if s is None else s.mean_ttft_s,
        queue_mean_s=None if lt is None else lt.queue_mean_s,
        nixl_xfer_mean_s=None if s is None else s.mean_nixl_xfer_s,
        nixl_transfers=0.0 if s is None else s.increases.get("nixl_xfer_time_count", 0.0),
        ttft_recent_s=None if r is None else r.mean_ttft_s,
        ttft_recent_count=0.0 if r is None else r.increases.get("ttft_count", 0.0),
        nixl_recent_s=None if r is None else r.mean_nixl_xfer_s,
        nixl_recent_count=0.0 if r is None else r.increases.get("nixl_xfer_time_count", 0.0),
        failed_transfers_per_min=(s.failed_transfers_per_min or 0.0) if s is not None else 0.0,
        expired_leases_per_min=expired_per_min(s, rec),
        **_handoff_percentiles(handoff),
        unattributed_lease_expiries=unattributed_expiries(role, s, rec),
        load_done=finished(r, role, cfg.handoff),
        **_charged(role, rec),
        restarted_at=restarted_at,
        identity=identity,
    )


def _handoff_percentiles(handoff: Percentiles | None) -> dict[str, Any]:
    return {} if handoff is None else {"handoff_p50_s": handoff.p50_s, "handoff_p99_s": handoff.p99_s}


def _charged(role: Role, tally: InstanceTally | None) -> dict[str, Any]:
    """The figures of the records charged to the instance (none: the fields' defaults); P's handoffs it
    prefilled that no D served among them, and the last few of their ids."""
    if tally is None:
        return {}
    return {
        "contribution_s": mean(tally.contribution),
        "requests": tally.requests,
        "failed_requests": tally.failed,
        "refused_requests": tally.refused,
        "lease_expiry_suspects": tally.lease_charged if role == "decode" else 0,
        "contribution_rse": rse(tally.contribution),
        "handoff_rse": rse(tally.handoff),
        "unpulled_handoffs": tally.unpulled,
        "unpulled_ids": tuple(tally.unpulled_ids),
    }


def _pulls_at_d(role: Role, latest: LatestGauges | None) -> dict[str, Any]:
    """D's KV-fetch gauges: its handoffs waiting at D (not pulling), and those still to pull from a P."""
    if latest is None or role != "decode":
        return {}
    return {"handoff_backlog": latest.waiting, "pulls_pending": latest.pulling}


def unattributed_expiries(role: Role, window: ScrapeFigures | None, tally: InstanceTally | None) -> int:
    """P: its own lease expiries (vLLM's counter) in the window that no waiting handoff explains (a
    handoff D refused as the client's error explains one too)."""
    if window is None or role != "prefill":
        return 0
    expired = round(window.increases.get("nixl_kv_expired_reqs", 0.0))
    return max(0, expired - (0 if tally is None else tally.lease_on_p + tally.lease_refused))


def expired_per_min(window: ScrapeFigures | None, tally: InstanceTally | None) -> float:
    """Lease expiries per minute that count as evidence (the ``KVLeaseExpired`` alert's): vLLM's rate
    less the share explained by requests D refused as the client's error."""
    rate = (window.expired_leases_per_min or 0.0) if window is not None else 0.0
    refused = 0 if tally is None else tally.lease_refused
    if not rate or not refused or window is None:
        return rate
    expired = window.increases.get("nixl_kv_expired_reqs", 0.0)
    return 0.0 if expired <= refused else rate * (expired - refused) / expired


def pool_signals(
    name: str,
    agg: PoolTally,
    members: Sequence[InstanceSignals],
    tally: WindowTally,
    rate_span: float,
    cfg: EvidenceConfig,
    pcts: PairPercentiles | None = None,
) -> PoolSignals:
    """One pool's load from its members' signals and the records through it (``pcts``: the pairs'
    percentiles, worked out from ``tally`` where not given)."""
    pcts = pcts if pcts is not None else PairPercentiles.of(tally, cfg)
    usages = [i.kv_usage for i in members if i.up and i.kv_usage is not None]
    rate = agg.done / rate_span if agg.done >= cfg.pool_min_requests else None
    mean_res = mean(agg.residence)
    pct = cfg.ttft_percentile
    side = 0 if agg.role == "prefill" else 1
    up = {i.name for i in members if i.up}
    prefill = agg.role == "prefill"
    return PoolSignals(
        name=name,
        role=agg.role,
        inflight_requests=None if rate is None or mean_res is None else rate * mean_res,
        completed_per_s=rate,
        ttft_at_slo_s=median_of_pairs(pcts.ttft, side, up, pct, cfg),
        kv_usage=mean([u for u in usages if u is not None]),
        # The typical member's backlog and queue times the members: one D that does not pull, or one slow P
        # (the weights' business: its peers take its share), does not read as the whole pool being behind.
        handoff_backlog_requests=typical_times_members(members, "handoff_backlog"),
        mean_kv_bytes_per_request=mean(agg.kv_bytes),
        waiting_now=typical_times_members(members, "num_waiting") if prefill else None,
        running_now=sum_up(members, "num_running") if prefill else None,
        service_ttft_at_slo_s=median_of_pairs(pcts.service, side, up, pct, cfg, agg.service_ttft),
        unqueued_ttft_at_slo_s=median_of_pairs(pcts.unqueued, side, up, pct, cfg, agg.unqueued_ttft),
    )


def fleet_handoff_p99(tally: WindowTally) -> float | None:
    return percentile(tally.handoffs, 99)
