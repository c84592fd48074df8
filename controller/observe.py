"""Read a recent window from the store into one frozen :class:`Observation`.

This is the controller's only reader of snapshots and request records. It uses the
shared derived-signal queries in ``store.queries`` (counter increases with resets,
handoff percentiles, SLO summaries) and keeps here only what is specific to the
controller: per-instance stage contributions, pool residence times (Little's law), the
KV-fetch backlog gauges and the SLO percentiles at the configured percentile.

What it believes: with ``controller.trusted_span_senders`` set, only request records whose
``sender`` is in that list (the rest are counted, ``Observation.untrusted_records``). A
request refused as invalid (a 4xx other than 429: ``store.queries.is_client_error``) is
charged to no instance: it is left out of every per-instance, per-pair and per-pool figure
(handoffs, lease-expiry suspects, failures, residence) and only counted as
``refused_requests``.

It reads; it never writes and never decides. Errors from the database surface as
``store.StoreError`` through ``store.transaction`` in the caller.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from statistics import median_low
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controller.policy.signals import InstanceSignals, Observation, PairSignals, PoolSignals, Role, SLOFigures
from pdscope.config import Settings
from store import queries as q
from store.models import RequestRecord, Snapshot

# A P x D pair's TTFT percentile needs this many requests in the window to count.
MIN_TTFT_SAMPLES = 10
# A pool's completion rate (and so its backlog in seconds) needs this many requests.
MIN_POOL_REQUESTS = 20
# When rates are taken over the span the window's records cover, never a shorter one than this.
MIN_RATE_SPAN_S = 2.0
# Failed request outcomes charged to the instance that failed them (a 503 refusal is overload, like a 429).
FAILED = frozenset({"error", "timeout"})
NOT_CHARGED_ERRORS = frozenset({"upstream_status_503"})
# An expired lease is counted a lease after the request came in: suspects are looked for this many leases back.
LEASE_LOOKBACK = 4.0


@dataclass(frozen=True)
class _Latest:
    backlog: float | None
    queue_mean_s: float | None
    down_for_s: float | None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _hold_time(load: float | None, r: q.InstanceSignals | None, role: Role, span_s: float) -> float | None:
    """Little's law: requests held now ÷ finished per second over the span the scrapes cover (else
    ``span_s``), counting TTFTs at P and NIXL transfers at D.

    Nothing finished while something is held counts as half a completion: a stuck instance
    reads as very slow, not as unknown.
    """
    if load is None or r is None:
        return None
    if load <= 0:
        return 0.0
    done = r.increases.get("ttft_count" if role == "prefill" else "nixl_xfer_time_count")
    if done is None:
        return None
    return load / (max(done, 0.5) / (r.seconds or span_s))


def _done_recent(r: q.InstanceSignals | None, role: Role) -> float | None:
    """Requests (P: TTFTs) or NIXL transfers (D) finished over the last three scrapes."""
    if r is None:
        return None
    return r.increases.get("ttft_count" if role == "prefill" else "nixl_xfer_time_count")


def _load_now(role: Role, s: q.InstanceSignals | None, lt: _Latest | None) -> float | None:
    """P: running + waiting at the latest scrape; D: the KV-fetch backlog at the latest scrape."""
    if role == "decode":
        return None if lt is None else lt.backlog
    if s is None or s.num_running is None or s.num_waiting is None:
        return None
    return s.num_running + s.num_waiting


def _typical_times_members(members: list[InstanceSignals], attr: str) -> float | None:
    """The lower median over the up members of a gauge, times their number."""
    values = [float(v) for i in members if i.up and (v := getattr(i, attr)) is not None]
    return median_low(values) * len(values) if values else None


def _sum_up(members: list[InstanceSignals], attr: str) -> float | None:
    """A gauge summed over the up members at their latest scrape."""
    values = [float(v) for i in members if i.up and (v := getattr(i, attr)) is not None]
    return sum(values) if values else None


def _latest_gauges(rows_by_instance: dict[str, list[Any]], since: float, until: float) -> dict[str, _Latest]:
    """Per instance: the latest KV-fetch gauges and the mean queue time over the window's rows."""
    out: dict[str, _Latest] = {}
    for inst, rows in rows_by_instance.items():
        up_rows = [r for r in rows if r.up]
        down_since: float | None = None
        for r in reversed(rows):  # the first of the trailing run of down scrapes
            if r.up:
                break
            down_since = r.ts
        # No up scrape in the whole window: down at least since the window began.
        down_for = None if down_since is None else max(0.0, until - (since if not up_rows else down_since))
        if not up_rows:
            out[inst] = _Latest(None, None, down_for)
            continue
        last = up_rows[-1]
        parts = [v for v in (last.kv_fetch_waiting_to_start, last.kv_fetch_in_progress,
                             last.kv_fetch_completed_waiting) if v is not None]
        backlog = sum(parts) if parts else None
        qsum = q.counter_increase(r.queue_sum for r in up_rows)
        qcnt = q.counter_increase(r.queue_count for r in up_rows)
        out[inst] = _Latest(backlog, qsum / qcnt if qsum is not None and qcnt else None, down_for)
    return out


@dataclass
class _RecordAgg:
    contribution: list[float]
    handoff: list[float] = field(default_factory=list)
    requests: int = 0
    failed: int = 0
    refused: int = 0
    lease_charged: int = 0
    lease_on_p: int = 0  # P: expired leases of this P the collector attributed to a waiting handoff


@dataclass
class _PoolAgg:
    role: Role
    residence: list[float]
    kv_bytes: list[float]
    service_ttft: list[float]
    unqueued_ttft: list[float] = field(default_factory=list)
    done: int = 0


def _records(session: Session, since: float, until: float, only: q.RecordFilter) -> Iterable[tuple[object, ...]]:
    stmt = select(
        RequestRecord.p_instance, RequestRecord.d_instance, RequestRecord.p_pool, RequestRecord.d_pool,
        RequestRecord.status, RequestRecord.http_status, RequestRecord.proxy_in, RequestRecord.p_sent,
        RequestRecord.p_done, RequestRecord.d_sent, RequestRecord.first_token, RequestRecord.done,
        RequestRecord.ttft_s, RequestRecord.kv_bytes, RequestRecord.error, RequestRecord.lease_expiry_suspect,
        RequestRecord.p_queue_s,
    ).where(RequestRecord.proxy_in >= since, RequestRecord.proxy_in <= until)
    return session.connection().execute(only.apply(stmt)).all()  # Core rows at once, unpacked like tuples


def _charge_attempts(session: Session, since: float, until: float, only: q.RecordFilter,
                     per_inst: dict[str, _RecordAgg]) -> None:
    """Failed attempts a retried record does not show itself (the collector reads them from the spans):
    each is charged to the P or D that failed it."""
    stmt = select(RequestRecord.attributes).where(RequestRecord.proxy_in >= since, RequestRecord.proxy_in <= until,
                                                  RequestRecord.retries > 0)
    for (attrs,) in session.execute(only.apply(stmt)):
        for a in (attrs or {}).get("failed_attempts") or [] if isinstance(attrs, dict) else []:
            inst, kind = (a.get("instance"), a.get("kind")) if isinstance(a, dict) else (None, None)
            if isinstance(inst, str) and f"upstream_{kind}" not in NOT_CHARGED_ERRORS:
                per_inst[inst].failed += 1


def _charge_leases(session: Session, since: float, until: float, lease_s: float, only: q.RecordFilter,
                   per_inst: dict[str, _RecordAgg]) -> None:
    """Expired leases the collector attributed (``attributes["lease_expiry"]``) and counted in the window:
    each charged to the D its handoff was sent to, and counted on the P whose lease it was. A suspect
    without that detail is charged to its record's D when the record ended in the window."""
    stmt = select(RequestRecord.d_instance, RequestRecord.done, RequestRecord.proxy_in, RequestRecord.attributes).where(
        RequestRecord.proxy_in >= since - LEASE_LOOKBACK * lease_s, RequestRecord.proxy_in <= until,
        RequestRecord.lease_expiry_suspect.is_(True))
    for d_inst, done, t_in, attrs in session.execute(only.apply(stmt)):
        entries = attrs.get("lease_expiry") if isinstance(attrs, dict) else None
        if not entries:
            at = done if isinstance(done, float) else t_in
            if isinstance(d_inst, str) and since <= at <= until:
                per_inst[d_inst].lease_charged += 1
            continue
        for e in entries if isinstance(entries, list) else []:
            ts = e.get("to_ts") if isinstance(e, dict) else None
            if not isinstance(ts, int | float) or not since <= ts <= until:
                continue
            if isinstance(e.get("d_instance"), str):
                per_inst[e["d_instance"]].lease_charged += 1
            if isinstance(e.get("p_instance"), str):
                per_inst[e["p_instance"]].lease_on_p += 1


def _pairs_percentile(by_pair: dict[tuple[str, str], list[float]], side: int, members: set[str], pct: float,
                      pooled: list[float] | None = None) -> float | None:
    """A pool's latency percentile: the lower median, over the P x D pairs through its up ``members``
    (``side`` 0: P, 1: D), of each pair's percentile. One slow P or D (the weights' job) slows at most
    half the pairs, so it does not read as the whole pool being slow; overload slows every pair. Where
    no pair has enough samples yet (a large fleet, a short window), the ``pooled`` percentile if given."""
    per = sorted(v for pair, vals in by_pair.items()
                 if pair[side] in members and len(vals) >= MIN_TTFT_SAMPLES
                 and (v := q.percentile(vals, pct)) is not None)
    if per:
        return median_low(per)
    if pooled is not None and len(pooled) >= MIN_TTFT_SAMPLES:
        return q.percentile(pooled, pct)
    return None


def _rse(values: list[float]) -> float | None:
    """Relative standard error of the mean of ``values`` (None for fewer than two)."""
    if len(values) < 2:
        return None
    n = len(values)
    m = sum(values) / n
    if m <= 0:
        return None
    # population standard deviation in floats (statistics.pstdev's exact fractions cost a tick
    # a third of a second at 1,000 instances)
    var = max(0.0, sum((v - m) * (v - m) for v in values) / n)
    return math.sqrt(var) / (m * math.sqrt(n))


def trusted_filter(settings: Settings) -> q.RecordFilter:
    """The records the controller believes (``controller.trusted_span_senders``)."""
    senders = settings.controller.trusted_span_senders
    return q.RecordFilter(None if senders is None else frozenset(senders))


def _slo(session: Session, settings: Settings, now: float, only: q.RecordFilter) -> SLOFigures:
    window = settings.slo.window_s
    summary = q.slo_summary(
        session, now - window, now, only=only,
        slo_percentiles=(settings.slo.ttft.percentile, settings.slo.tpot.percentile),
    ).get("all")
    if summary is None:
        return SLOFigures(window_s=window)
    return SLOFigures(
        window_s=window,
        completed=summary.completed,
        met=summary.slo_met,
        rejected=summary.statuses.get("rejected", 0),
        ttft_p_s=summary.ttft_at_slo_s,
        tpot_p_s=summary.tpot_at_slo_s,
        goodput_rps=summary.goodput_per_s,
    )


def observe(session: Session, settings: Settings, now: float, window_s: float | None = None) -> Observation:
    """Everything one tick needs, for every configured instance (unscraped ones have ``up=None``)."""
    window = window_s if window_s is not None else settings.controller.window_s
    since = now - window
    snaps = q.snapshot_window(session, since, now)  # one read: the window, its tail and the latest gauges
    sigs = q.signals_of_rows(snaps)
    recent_s = max(3.0, 3.0 * settings.collector.scrape_interval_s)  # the last three scrapes
    recent = q.signals_of_rows(snaps, since=now - recent_s)
    latest = _latest_gauges(snaps, since, now)
    trusted = trusted_filter(settings)
    charged = replace(trusted, charged_only=True)

    per_inst: dict[str, _RecordAgg] = defaultdict(lambda: _RecordAgg([]))
    pools: dict[str, _PoolAgg] = {name: _PoolAgg(p.role, [], [], []) for name, p in settings.pools.items()}
    ttft_by_pair: dict[tuple[str, str], list[float]] = defaultdict(list)
    service_by_pair: dict[tuple[str, str], list[float]] = defaultdict(list)
    unqueued_by_pair: dict[tuple[str, str], list[float]] = defaultdict(list)
    handoffs: list[float] = []
    first_in = now
    charged_handoffs: list[tuple[object, ...]] = []  # the rows q.handoff_stats_of reads
    for (p_inst, d_inst, p_pool, d_pool, status, http, t_in, p_sent, p_done, d_sent, first, done, ttft,
         kvb, error, suspect, p_queue) in _records(session, since, now, trusted):
        if q.is_client_error(status if isinstance(status, str) else None, http if isinstance(http, int) else None):
            for inst in (p_inst, d_inst):  # refused as invalid: nobody's fault, counted only
                if isinstance(inst, str):
                    per_inst[inst].refused += 1
            continue
        charged_handoffs.append((p_inst, d_inst, p_done, first, suspect))
        ok = status == "ok"
        failed = status in FAILED and error not in NOT_CHARGED_ERRORS
        decoded = d_sent is not None
        for inst in (p_inst, d_inst):
            if isinstance(inst, str):
                per_inst[inst].requests += 1
        # A failure is its stage's: D's once the decode stage began, else P's.
        if failed and isinstance(d_inst, str) and decoded:
            per_inst[d_inst].failed += 1
        elif failed and isinstance(p_inst, str) and not decoded:
            per_inst[p_inst].failed += 1
        if ok and isinstance(ttft, float) and isinstance(p_inst, str) and isinstance(d_inst, str):
            ttft_by_pair[(p_inst, d_inst)].append(ttft)
        if isinstance(p_inst, str) and isinstance(p_sent, float) and isinstance(p_done, float):
            per_inst[p_inst].contribution.append(max(0.0, p_done - p_sent))
        if isinstance(d_inst, str) and isinstance(d_sent, float) and isinstance(first, float):
            per_inst[d_inst].contribution.append(max(0.0, first - d_sent))
        if isinstance(p_done, float) and isinstance(first, float):
            handoffs.append(max(0.0, first - p_done))
            for inst in (p_inst, d_inst):
                if isinstance(inst, str):
                    per_inst[inst].handoff.append(max(0.0, first - p_done))
        if not isinstance(t_in, float):
            continue
        first_in = min(first_in, t_in)
        # TTFT without the wait for an admission slot in the proxy (proxy in -> sent to P).
        service = ttft - max(0.0, p_sent - t_in) if ok and isinstance(ttft, float) and isinstance(
            p_sent, float) else None
        unqueued = max(0.0, service - p_queue) if service is not None and isinstance(p_queue, float) else None
        pair = (p_inst, d_inst) if isinstance(p_inst, str) and isinstance(d_inst, str) else None
        if pair is not None and service is not None:
            service_by_pair[pair].append(service)
        if pair is not None and unqueued is not None:
            unqueued_by_pair[pair].append(unqueued)
        for pool_name, end in ((p_pool, p_done), (d_pool, done)):
            agg = pools.get(pool_name) if isinstance(pool_name, str) else None
            if agg is not None and service is not None:
                agg.service_ttft.append(service)
            if agg is not None and unqueued is not None:
                agg.unqueued_ttft.append(unqueued)
            if agg is None or not isinstance(end, float):
                continue
            agg.done += 1
            agg.residence.append(max(0.0, end - t_in))
            if isinstance(kvb, int):
                agg.kv_bytes.append(float(kvb))

    hand = q.handoff_stats_of(charged_handoffs, ("d_instance", "p_instance", "pair"))
    by_d, by_p, pairs = hand["d_instance"], hand["p_instance"], hand["pair"]
    _charge_attempts(session, since, now, charged, per_inst)
    _charge_leases(session, since, now, settings.controller.kv_lease_s, charged, per_inst)

    instances: list[InstanceSignals] = []
    newest: float | None = None
    unattributed = 0
    for pool_name, inst in settings.instances():
        role = settings.pools[pool_name].role
        s = sigs.get(inst.name)
        lt = latest.get(inst.name)
        r = recent.get(inst.name)
        held = _load_now(role, s, lt)
        rec = per_inst.get(inst.name)
        hs = (by_d if role == "decode" else by_p).get(inst.name)
        if s is not None:
            newest = s.last_ts if newest is None else max(newest, s.last_ts)
        expired = round(s.increases.get("nixl_kv_expired_reqs", 0.0)) if s is not None and role == "prefill" else 0
        unexplained = max(0, expired - (0 if rec is None else rec.lease_on_p))
        unattributed += unexplained
        instances.append(InstanceSignals(
            name=inst.name, pool=pool_name, role=role,
            up=None if s is None else s.up,
            last_seen=None if s is None else s.last_ts,
            down_for_s=None if lt is None else lt.down_for_s,
            kv_usage=None if s is None else s.kv_cache_usage,
            num_running=None if s is None else s.num_running,
            num_waiting=None if s is None else s.num_waiting,
            handoff_backlog=None if lt is None or role != "decode" else lt.backlog,
            load_now=held,
            hold_time_now_s=_hold_time(held, r, role, recent_s),
            ttft_mean_s=None if s is None else s.mean_ttft_s,
            queue_mean_s=None if lt is None else lt.queue_mean_s,
            nixl_xfer_mean_s=None if s is None else s.mean_nixl_xfer_s,
            nixl_transfers=0.0 if s is None else s.increases.get("nixl_xfer_time_count", 0.0),
            ttft_recent_s=None if r is None else r.mean_ttft_s,
            ttft_recent_count=0.0 if r is None else r.increases.get("ttft_count", 0.0),
            nixl_recent_s=None if r is None else r.mean_nixl_xfer_s,
            nixl_recent_count=0.0 if r is None else r.increases.get("nixl_xfer_time_count", 0.0),
            failed_transfers_per_min=(s.failed_transfers_per_min or 0.0) if s is not None else 0.0,
            expired_leases_per_min=(s.expired_leases_per_min or 0.0) if s is not None else 0.0,
            contribution_s=None if rec is None else _mean(rec.contribution),
            handoff_p50_s=None if hs is None else hs.p50_s,
            handoff_p99_s=None if hs is None else hs.p99_s,
            requests=0 if rec is None else rec.requests,
            failed_requests=0 if rec is None else rec.failed,
            refused_requests=0 if rec is None else rec.refused,
            lease_expiry_suspects=rec.lease_charged if rec is not None and role == "decode" else 0,
            unattributed_lease_expiries=unexplained,
            contribution_rse=None if rec is None else _rse(rec.contribution),
            handoff_rse=None if rec is None else _rse(rec.handoff),
            load_done=_done_recent(r, role),
        ))
    if newest is None:
        newest = session.scalar(select(func.max(Snapshot.ts)))

    # Right after a start the window is not full yet: when its earliest record is more than a
    # quarter of the way in, rates are taken over the span the records cover, not the window.
    covered = window if first_in - since <= window / 4 else max(now - first_in, MIN_RATE_SPAN_S)
    # How long the store has watched the fleet: since its first snapshot (retention keeps the newest; by
    # then the start-up is long over). A window that holds any of the start-up is a start-up window.
    first_ever = session.scalar(select(func.min(Snapshot.ts)))
    history = max(0.0, now - first_ever) if first_ever is not None else 0.0
    pool_sigs: list[PoolSignals] = []
    for name, agg in pools.items():
        members = [i for i in instances if i.pool == name]
        usages = [i.kv_usage for i in members if i.up and i.kv_usage is not None]
        rate = agg.done / covered if agg.done >= MIN_POOL_REQUESTS else None
        mean_res = _mean(agg.residence)
        pct = settings.slo.ttft.percentile
        side = 0 if agg.role == "prefill" else 1
        up_members = {i.name for i in members if i.up}
        pool_sigs.append(PoolSignals(
            name=name, role=agg.role,
            inflight_requests=None if rate is None or mean_res is None else rate * mean_res,
            completed_per_s=rate,
            ttft_p_s=_pairs_percentile(ttft_by_pair, side, up_members, pct),
            kv_usage=_mean([u for u in usages if u is not None]),
            # The typical member's backlog (the lower median, as for P's queue) times the members: one D
            # that does not pull (the weights' job) does not read as the whole pool being behind. (The
            # plain median of four averaged one bad D's backlog into it: it cut the decode pool's limit
            # under one stuck D or one bad P x D link.)
            handoff_backlog_requests=_typical_times_members(members, "handoff_backlog"),
            mean_kv_bytes_per_request=_mean(agg.kv_bytes),
            # The typical member's queue times the members, like the backlog: one slow P's queue is the
            # weights' business (its peers take its share), a queue on every P is the pool's.
            waiting_now=_typical_times_members(members, "num_waiting") if agg.role == "prefill" else None,
            running_now=_sum_up(members, "num_running") if agg.role == "prefill" else None,
            service_ttft_p_s=_pairs_percentile(service_by_pair, side, up_members, pct, agg.service_ttft),
            unqueued_ttft_p_s=_pairs_percentile(unqueued_by_pair, side, up_members, pct, agg.unqueued_ttft),
        ))

    pair_sigs = tuple(
        PairSignals(p, d, hs.requests, hs.p50_s or 0.0, hs.p99_s or 0.0)
        for key, hs in sorted(pairs.items())
        for p, _, d in [key.partition("->")]
        if hs.requests
    )
    slo = _slo(session, settings, now, trusted)
    slo = SLOFigures(slo.window_s, slo.completed, slo.met, slo.rejected, slo.ttft_p_s, slo.tpot_p_s,
                     q.percentile(handoffs, 99), slo.goodput_rps)
    return Observation(now=now, window_s=window, instances=tuple(instances), pools=tuple(pool_sigs),
                       pairs=pair_sigs, slo=slo, newest_data=newest,
                       untrusted_records=q.untrusted_records(session, since, now, trusted.senders),
                       history_s=history, unattributed_lease_expiries=unattributed)
