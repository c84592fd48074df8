"""Derived signals: the store queries the collector, the controller and the dashboard share.

Every function takes a ``Session`` and a window ``[since, until]`` (Unix seconds) and
returns frozen values; none writes. Counters are stored cumulative, as scraped, so rates
come from differences between snapshots, and histogram quantiles from the buckets'
increase in the window; the arithmetic (increases across restarts, Prometheus's
``histogram_quantile()``, percentiles of raw values) is ``pdscope.stats``, and which
columns are read is ``store.families``.

"MB" is 10**6 bytes. A window needs two snapshots of an instance to give it a rate;
an instance with fewer gives ``None`` rates, never zero.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from sqlalchemy import ColumnElement, Select, and_, func, or_, select
from sqlalchemy.orm import Session

from pdscope.config import DEFAULT_TENANT, SLOSettings
from pdscope.slo import slo_verdict
from pdscope.stats import (
    Histogram,
    counter_increase,
    histogram_increase,
    merge_histograms,
    percentile,
    percentiles,
)
from store.families import WINDOW_COUNTERS, WINDOW_GAUGES, histogram_of
from store.models import RequestRecord, Snapshot

# The columns the window queries read from every snapshot (``store.families`` derives them).
COUNTERS: tuple[str, ...] = WINDOW_COUNTERS
GAUGES: tuple[str, ...] = WINDOW_GAUGES


@dataclass(frozen=True)
class ScrapeFigures:
    """One instance's scrapes over a window: rates (per second unless named per minute) and latest
    gauges. (The controller's per-instance signals are ``controller.policy.InstanceSignals``, built
    from these and the records.)"""

    instance: str
    pool: str
    role: str
    seconds: float | None
    scrapes: int
    up_ratio: float
    up: bool
    last_ts: float
    last_error: str | None
    increases: dict[str, float]
    latest: dict[str, float]
    prompt_tokens_per_s: float | None = None
    generation_tokens_per_s: float | None = None
    requests_per_s: float | None = None
    errors_per_s: float | None = None
    transfers_per_s: float | None = None
    kv_mb_per_s: float | None = None
    failed_transfers_per_min: float | None = None
    expired_leases_per_min: float | None = None
    admission_rejections_per_s: float | None = None
    mean_nixl_xfer_s: float | None = None
    mean_ttft_s: float | None = None
    kv_cache_usage: float | None = None
    kv_headroom: float | None = None
    num_running: float | None = None
    num_waiting: float | None = None


def _rate(inc: float | None, seconds: float | None, per: float = 1.0) -> float | None:
    if inc is None or not seconds:
        return None
    return inc / seconds * per


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or not den:
        return None
    return num / den


# The scalar columns the signal functions read (not the JSON ones); rows of these unpack fast.
_LIGHT_COLUMNS: tuple[str, ...] = ("instance", "pool", "role", "ts", "up", "error", *COUNTERS, *GAUGES)
# ... as the columns a window read selects (the controller's kept window selects these and the id)
SNAPSHOT_SCALARS = tuple(getattr(Snapshot, c) for c in dict.fromkeys(_LIGHT_COLUMNS))


def _snapshot_rows(
    session: Session,
    since: float,
    until: float,
    instance: str | None = None,
    pool: str | None = None,
    *,
    histograms: bool = False,
) -> dict[str, list[Any]]:
    """The window's snapshots per instance, in time order (then by id). Without ``histograms`` they are plain
    rows of the scalar columns (attribute access like a ``Snapshot``): building ORM objects and
    decoding the JSON columns was most of a controller tick's read at 1,000 instances. With it,
    full ``Snapshot`` objects for the histogram queries."""
    where = [Snapshot.ts >= since, Snapshot.ts <= until]
    if instance is not None:
        where.append(Snapshot.instance == instance)
    if pool is not None:
        where.append(Snapshot.pool == pool)
    out: dict[str, list[Any]] = defaultdict(list)
    if histograms:
        for snap in session.scalars(select(Snapshot).where(*where).order_by(Snapshot.ts, Snapshot.id)):
            out[snap.instance].append(snap)
        return out
    stmt = select(*SNAPSHOT_SCALARS).where(*where).order_by(Snapshot.ts, Snapshot.id)  # ids break ties
    for row in session.connection().execute(stmt).all():
        out[row.instance].append(row)
    return out


def _by_column(rows: Sequence[Any]) -> dict[str, Sequence[Any]]:
    """Each column of ``rows`` (the plain rows of :func:`_snapshot_rows`) in row order, transposed in
    one pass."""
    if not rows:
        return {col: () for col in (*COUNTERS, *GAUGES)}
    return dict(zip(rows[0]._fields, zip(*rows, strict=True), strict=True))


# The counters of finished requests, one per finish reason
_FINISHED = ("requests_stop", "requests_length", "requests_abort", "requests_error", "requests_repetition")


def _increases(columns: dict[str, Sequence[Any]]) -> dict[str, float]:
    """Each counter's increase over the rows (those it cannot tell left out)."""
    incs: dict[str, float] = {}
    for col in COUNTERS:
        inc = counter_increase(columns[col])
        if inc is not None:
            incs[col] = inc
    return incs


def _latest(columns: dict[str, Sequence[Any]]) -> dict[str, float]:
    """Each gauge's last value that is not null (gauges never set left out)."""
    latest: dict[str, float] = {}
    for col in GAUGES:
        v = next((x for x in reversed(columns[col]) if x is not None), None)
        if v is not None:
            latest[col] = v
    return latest


def _signals_of(name: str, rows: Sequence[Any]) -> ScrapeFigures:
    last = rows[-1]
    up_rows = [r for r in rows if r.up]
    seconds = (up_rows[-1].ts - up_rows[0].ts) if len(up_rows) >= 2 else None
    columns = _by_column(up_rows)
    incs = _increases(columns)
    latest = _latest(columns)
    finished = [incs[c] for c in _FINISHED if c in incs]
    requests = sum(finished) if finished else None
    rejections = [incs[c] for c in ("admission_rejections_reqs", "admission_rejections_tokens") if c in incs]
    usage = latest.get("kv_cache_usage")
    bytes_inc = incs.get("nixl_bytes_sum")
    return ScrapeFigures(
        instance=name,
        pool=last.pool,
        role=last.role,
        seconds=seconds,
        scrapes=len(rows),
        up_ratio=len(up_rows) / len(rows),
        up=last.up,
        last_ts=last.ts,
        last_error=last.error,
        increases=incs,
        latest=latest,
        prompt_tokens_per_s=_rate(incs.get("prompt_tokens"), seconds),
        generation_tokens_per_s=_rate(incs.get("generation_tokens"), seconds),
        requests_per_s=_rate(requests, seconds),
        errors_per_s=_rate(incs.get("requests_error"), seconds),
        transfers_per_s=_rate(incs.get("nixl_xfer_time_count"), seconds),
        kv_mb_per_s=_rate(None if bytes_inc is None else bytes_inc / 1e6, seconds),
        failed_transfers_per_min=_rate(incs.get("nixl_failed_transfers"), seconds, 60.0),
        expired_leases_per_min=_rate(incs.get("nixl_kv_expired_reqs"), seconds, 60.0),
        admission_rejections_per_s=_rate(sum(rejections) if rejections else None, seconds),
        mean_nixl_xfer_s=_ratio(incs.get("nixl_xfer_time_sum"), incs.get("nixl_xfer_time_count")),
        mean_ttft_s=_ratio(incs.get("ttft_sum"), incs.get("ttft_count")),
        kv_cache_usage=usage,
        kv_headroom=None if usage is None else max(0.0, 1.0 - usage),
        num_running=latest.get("num_running"),
        num_waiting=latest.get("num_waiting"),
    )


def instance_signals(
    session: Session, since: float, until: float, *, pool: str | None = None
) -> dict[str, ScrapeFigures]:
    """Per instance: rates over the window and the latest gauges, for every instance scraped in it."""
    return signals_of_rows(_snapshot_rows(session, since, until, pool=pool))


def snapshot_window(session: Session, since: float, until: float) -> dict[str, list[Any]]:
    """Every instance's scalar snapshot rows of the window, in time order, for a reader that derives
    several things from one read (:func:`signals_of_rows` over the window and over its tail)."""
    return _snapshot_rows(session, since, until)


# Per instance, the figures of its rows last worked out: (first row, last row, rows, figures)
FiguresMemo = dict[str, tuple[Any, Any, int, ScrapeFigures]]


def signals_of_rows(
    rows_by_instance: dict[str, list[Any]], since: float | None = None, memo: FiguresMemo | None = None
) -> dict[str, ScrapeFigures]:
    """:func:`instance_signals` over rows already read, only those at or after ``since`` if given.

    ``memo`` (one per window, kept by the caller between calls): an instance's figures are worked out again
    only when its rows are not the ones they were worked out from, that is when its first or last row is
    not the same object or their count differs. For rows kept between reads (``controller.snaprows``: each
    instance's held in time order, a window's a contiguous run of them, none changed in place) that is
    exactly when they differ; rows read anew are new objects, always worked out."""
    out: dict[str, ScrapeFigures] = {}
    for name, rows in rows_by_instance.items():
        if since is not None:
            rows = rows[bisect_left(rows, since, key=_ts) :]
        if not rows:
            continue
        hit = memo.get(name) if memo is not None else None
        if hit is not None and hit[0] is rows[0] and hit[1] is rows[-1] and hit[2] == len(rows):
            out[name] = hit[3]
            continue
        out[name] = _signals_of(name, rows)
        if memo is not None:
            memo[name] = (rows[0], rows[-1], len(rows), out[name])
    if memo is not None:
        for gone in memo.keys() - out.keys():
            del memo[gone]
    return out


def _ts(row: Any) -> float:
    return float(row.ts)


@dataclass(frozen=True)
class PoolScrapeFigures:
    pool: str
    role: str
    instances: int
    up: int
    prompt_tokens_per_s: float | None
    generation_tokens_per_s: float | None
    requests_per_s: float | None
    transfers_per_s: float | None
    kv_mb_per_s: float | None
    failed_transfers_per_min: float | None
    expired_leases_per_min: float | None
    kv_cache_usage: float | None  # mean over the pool's up instances
    kv_headroom: float | None
    num_waiting: float | None


def _sum(values: Iterable[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return sum(got) if got else None


def pool_scrape_figures(session: Session, since: float, until: float) -> dict[str, PoolScrapeFigures]:
    """Per pool: instance rates summed, KV usage averaged over up instances."""
    by_pool: dict[str, list[ScrapeFigures]] = defaultdict(list)
    for sig in instance_signals(session, since, until).values():
        by_pool[sig.pool].append(sig)
    out: dict[str, PoolScrapeFigures] = {}
    for pool, sigs in by_pool.items():
        usages = [s.kv_cache_usage for s in sigs if s.up and s.kv_cache_usage is not None]
        usage = sum(usages) / len(usages) if usages else None
        out[pool] = PoolScrapeFigures(
            pool=pool,
            role=sigs[0].role,
            instances=len(sigs),
            up=sum(1 for s in sigs if s.up),
            prompt_tokens_per_s=_sum(s.prompt_tokens_per_s for s in sigs),
            generation_tokens_per_s=_sum(s.generation_tokens_per_s for s in sigs),
            requests_per_s=_sum(s.requests_per_s for s in sigs),
            transfers_per_s=_sum(s.transfers_per_s for s in sigs),
            kv_mb_per_s=_sum(s.kv_mb_per_s for s in sigs),
            failed_transfers_per_min=_sum(s.failed_transfers_per_min for s in sigs),
            expired_leases_per_min=_sum(s.expired_leases_per_min for s in sigs),
            kv_cache_usage=usage,
            kv_headroom=None if usage is None else max(0.0, 1.0 - usage),
            num_waiting=_sum(s.num_waiting for s in sigs),
        )
    return out


# -- histograms -------------------------------------------------------------------------


def _hist_increase(rows: Sequence[Snapshot], family: str) -> Histogram | None:
    return histogram_increase(histogram_of(h) for h in (r.histograms.get(family) for r in rows if r.up) if h)


def histogram_window(
    session: Session,
    family: str,
    since: float,
    until: float,
    *,
    instance: str | None = None,
    pool: str | None = None,
) -> Histogram | None:
    """One histogram's increase over the window, over one instance, one pool, or everything."""
    rows = _snapshot_rows(session, since, until, instance=instance, pool=pool, histograms=True)
    return merge_histograms(d for d in (_hist_increase(r, family) for r in rows.values()) if d is not None)


def histogram_quantiles(
    session: Session,
    family: str,
    qs: Sequence[float],
    since: float,
    until: float,
    *,
    by: Literal["instance", "pool"] = "instance",
) -> dict[str, dict[float, float | None]]:
    """Quantiles ``qs`` of one histogram per instance or per pool over the window."""
    rows = _snapshot_rows(session, since, until, histograms=True)
    groups: dict[str, list[Histogram]] = defaultdict(list)
    for name, snaps in rows.items():
        d = _hist_increase(snaps, family)
        if d is not None:
            groups[name if by == "instance" else snaps[-1].pool].append(d)
    out: dict[str, dict[float, float | None]] = {}
    for key, deltas in groups.items():
        merged = merge_histograms(deltas)
        if merged is not None:
            out[key] = {q: merged.quantile(q) for q in qs}
    return out


# -- request records ----------------------------------------------------------------------

# A request the client got a 4xx for (other than 429, which is an overload answer) was
# refused as invalid: the instance that refused it did its job. An outcome of this name,
# if a sender uses it, means the same.
CLIENT_ERROR_OUTCOME = "client_error"


def is_client_error(status: str | None, http_status: int | None) -> bool:
    """Was this request refused as invalid (the client's fault, not any instance's)?"""
    if status == CLIENT_ERROR_OUTCOME:
        return True
    return http_status is not None and 400 <= http_status < 500 and http_status != 429


def _charged() -> ColumnElement[bool]:
    """SQL for ``not is_client_error(status, http_status)`` (a null status code is not a 4xx)."""
    h = RequestRecord.http_status
    return and_(RequestRecord.status != CLIENT_ERROR_OUTCOME, or_(h.is_(None), h < 400, h >= 500, h == 429))


_Stmt = TypeVar("_Stmt", bound="Select[*tuple[Any, ...]]")


@dataclass(frozen=True)
class RecordFilter:
    """Which request records a reader believes.

    ``senders``: only records whose ``sender`` (the OTLP token name of the proxy root span)
    is one of these; ``None`` = every record, a null sender (sent without auth) never matches
    a list. ``charged_only``: leave out requests refused as invalid (:func:`is_client_error`).
    ``tenant``: only that tenant's records (the ``default`` tenant's are also those with none).
    """

    senders: frozenset[str] | None = None
    charged_only: bool = False
    tenant: str | None = None

    def apply(self, stmt: _Stmt) -> _Stmt:
        if self.senders is not None:
            stmt = stmt.where(RequestRecord.sender.in_(sorted(self.senders)))
        if self.charged_only:
            stmt = stmt.where(_charged())
        if self.tenant == DEFAULT_TENANT:
            stmt = stmt.where(or_(RequestRecord.tenant == self.tenant, RequestRecord.tenant.is_(None)))
        elif self.tenant is not None:
            stmt = stmt.where(RequestRecord.tenant == self.tenant)
        return stmt


EVERY_RECORD = RecordFilter()


def untrusted_records(session: Session, since: float, until: float, senders: frozenset[str] | None) -> int:
    """Records in the window whose sender is not one of ``senders`` (0 when ``senders`` is None)."""
    if senders is None:
        return 0
    stmt = (
        select(func.count())
        .select_from(RequestRecord)
        .where(
            RequestRecord.proxy_in >= since,
            RequestRecord.proxy_in <= until,
            or_(RequestRecord.sender.is_(None), RequestRecord.sender.not_in(sorted(senders))),
        )
    )
    return int(session.scalar(stmt) or 0)


@dataclass(frozen=True)
class HandoffStats:
    """Handoff time (P done → D first token, i.e. D's queue incl. the KV pull) of a group."""

    key: str
    requests: int
    p50_s: float | None
    p90_s: float | None
    p99_s: float | None
    mean_s: float | None
    lease_suspects: int


HandoffKey = Literal["d_instance", "p_instance", "pair"]


def handoff_stats(
    session: Session,
    since: float,
    until: float,
    *,
    by: HandoffKey = "pair",
    only: RecordFilter = EVERY_RECORD,
) -> dict[str, HandoffStats]:
    """Handoff percentiles per D, per P or per ``"P->D"`` pair, from request records (``only`` those)."""
    return handoff_stats_by(session, since, until, (by,), only=only)[by]


def handoff_stats_by(
    session: Session,
    since: float,
    until: float,
    bys: Sequence[HandoffKey],
    *,
    only: RecordFilter = EVERY_RECORD,
) -> dict[HandoffKey, dict[str, HandoffStats]]:
    """:func:`handoff_stats` for several groupings from one read of the window's records."""
    stmt = select(
        RequestRecord.p_instance,
        RequestRecord.d_instance,
        RequestRecord.p_done,
        RequestRecord.first_token,
        RequestRecord.lease_expiry_suspect,
    ).where(RequestRecord.proxy_in >= since, RequestRecord.proxy_in <= until)
    return handoff_stats_of(session.connection().execute(only.apply(stmt)).all(), bys)


def handoff_stats_of(
    rows: Iterable[Sequence[Any]],
    bys: Sequence[HandoffKey],
) -> dict[HandoffKey, dict[str, HandoffStats]]:
    """:func:`handoff_stats_by` over rows already read: (p_instance, d_instance, p_done, first_token,
    lease_expiry_suspect) each."""
    groups: dict[HandoffKey, dict[str, list[float]]] = {by: defaultdict(list) for by in bys}
    suspects: dict[HandoffKey, dict[str, int]] = {by: defaultdict(int) for by in bys}
    for p, d, p_done, first, suspect in rows:
        took = handoff_took(p_done, first)
        if took is None:
            continue
        keys = handoff_keys(p, d)
        for by in bys:
            key = keys[by]
            groups[by][key].append(took)
            suspects[by][key] += int(bool(suspect))
    return {
        by: {key: handoff_group(key, vals, suspects[by][key]) for key, vals in groups[by].items()}
        for by in bys
    }


def handoff_took(p_done: Any, first: Any) -> float | None:
    """A handoff's time, P done to D's first token (None: it did not happen)."""
    return None if p_done is None or first is None else max(0.0, first - p_done)


def handoff_keys(p: object, d: object) -> dict[HandoffKey, str]:
    """The groups a handoff through ``p`` and ``d`` counts in (a name missing: ``""``; in a pair ``None``)."""
    return {"d_instance": str(d or ""), "p_instance": str(p or ""), "pair": f"{p}->{d}"}


def handoff_group(key: str, vals: Sequence[float], suspects: int) -> HandoffStats:
    """One group's figures: its percentiles, its mean summed exactly (the same in any order), its suspects."""
    p50, p90, p99 = percentiles(vals, (50, 90, 99))
    return HandoffStats(key, len(vals), p50, p90, p99, math.fsum(vals) / len(vals), suspects)


def slo_met_clause(slo: SLOSettings) -> ColumnElement[bool]:
    """SQL for "met every SLO under ``slo``" (``pdscope.slo.slo_verdict``'s rule, over the stored
    status, ``ttft_s`` and ``tpot_s``), for readers that count verdicts in the database."""
    return and_(
        RequestRecord.status == "ok",
        RequestRecord.ttft_s.is_not(None),
        RequestRecord.ttft_s * 1000.0 <= slo.ttft.target_ms,
        or_(RequestRecord.tpot_s.is_(None), RequestRecord.tpot_s * 1000.0 <= slo.tpot.target_ms),
    )


@dataclass(frozen=True)
class SLOSummary:
    """SLO attainment = requests meeting every SLO / completed; goodput = those per second."""

    key: str
    requests: int
    completed: int
    slo_met: int
    attainment: float | None
    goodput_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p99_s: float | None
    e2e_p99_s: float | None
    statuses: dict[str, int] = field(default_factory=dict)
    # TTFT and TPOT of completed requests at the SLO's own percentiles, when slo_summary is asked
    ttft_at_slo_s: float | None = None
    tpot_at_slo_s: float | None = None


def slo_summary(
    session: Session,
    since: float,
    until: float,
    *,
    by: Literal["all", "d_instance", "p_instance", "d_pool", "p_pool"] = "all",
    only: RecordFilter = EVERY_RECORD,
    slo_percentiles: tuple[float, float] | None = None,
    slo: SLOSettings | None = None,
) -> dict[str, SLOSummary]:
    """SLO attainment and goodput over the window, overall (key ``"all"``) or per group (``only`` those).

    ``slo_percentiles`` = (TTFT's, TPOT's): also fill ``ttft_at_slo_s`` / ``tpot_at_slo_s``. With ``slo``,
    each record's verdict is recomputed under it (``pdscope.slo``) rather than read as stored, so a
    changed ``slo.*`` applies to the whole window at once."""
    rows = _slo_rows(session, since, until, by, only)
    span = max(until - since, 1e-9)
    return {key: _slo_summary_of(key, group, span, slo_percentiles, slo) for key, group in rows.items()}


def completed_ttfts(
    session: Session, since: float, until: float, *, only: RecordFilter = EVERY_RECORD
) -> list[float]:
    """The TTFTs of the window's completed requests (``only`` those), the values :func:`slo_summary`'s
    ``ttft_p99_s`` is the percentile of, in arrival order (``proxy_in``): the order in which their
    clumps are read (``pdscope.stats.effective_size``)."""
    rr = RequestRecord
    stmt = only.apply(
        select(rr.ttft_s)
        .where(rr.proxy_in >= since, rr.proxy_in <= until, rr.status == "ok", rr.ttft_s.is_not(None))
        .order_by(rr.proxy_in, rr.id)
    )
    return [float(t) for t in session.scalars(stmt) if t is not None]


def _slo_rows(
    session: Session, since: float, until: float, by: str, only: RecordFilter
) -> dict[str, list[Any]]:
    """The window's (status, slo_met, ttft_s, tpot_s, e2e_s[, group]) rows by group (``"all"``: one)."""
    # only the grouping column is read besides the figures: the controller's 300 s "all" read
    # at 1,000 instances spent most of its time decoding four instance and pool names per row
    group_col = None if by == "all" else getattr(RequestRecord, by)
    cols = [
        RequestRecord.status,
        RequestRecord.slo_met,
        RequestRecord.ttft_s,
        RequestRecord.tpot_s,
        RequestRecord.e2e_s,
    ]
    stmt = only.apply(
        select(*cols, *([] if group_col is None else [group_col])).where(
            RequestRecord.proxy_in >= since, RequestRecord.proxy_in <= until
        )
    )
    rows: dict[str, list[Any]] = defaultdict(list)
    # Core rows, fetched at once: the ORM layer and a fetch per row add nothing to a column read
    result = session.connection().execute(stmt).all()
    if group_col is None:
        rows["all"] = list(result)
        if not rows["all"]:
            del rows["all"]
    else:
        for row in result:
            key = row[5]
            rows[key if isinstance(key, str) else ""].append(row)
    return rows


def _slo_summary_of(
    key: str,
    group: list[Any],
    span: float,
    slo_percentiles: tuple[float, float] | None,
    slo: SLOSettings | None,
) -> SLOSummary:
    """One group's summary (:func:`slo_summary`) of its rows over ``span`` seconds."""
    statuses: dict[str, int] = defaultdict(int)
    for r in group:
        statuses[r[0]] += 1
    completed = [r for r in group if r[0] == "ok"]
    if slo is None:
        met = sum(1 for r in completed if r[1])
    else:
        met = sum(1 for r in completed if slo_verdict(r[0], r[2], r[3], slo).met)
    ttfts = [r[2] for r in completed if r[2] is not None]
    tpots = [r[3] for r in completed if r[3] is not None]
    e2es = [r[4] for r in completed if r[4] is not None]
    at_ttft, at_tpot = (None, None) if slo_percentiles is None else slo_percentiles
    ttft_p50, ttft_p99, ttft_at = percentiles(ttfts, (50, 99, 99 if at_ttft is None else at_ttft))
    tpot_p99, tpot_at = percentiles(tpots, (99, 99 if at_tpot is None else at_tpot))
    return SLOSummary(
        key=key,
        requests=len(group),
        completed=len(completed),
        slo_met=met,
        attainment=met / len(completed) if completed else None,
        goodput_per_s=met / span,
        ttft_p50_s=ttft_p50,
        ttft_p99_s=ttft_p99,
        tpot_p99_s=tpot_p99,
        e2e_p99_s=percentile(e2es, 99),
        statuses=dict(statuses),
        ttft_at_slo_s=None if at_ttft is None else ttft_at,
        tpot_at_slo_s=None if at_tpot is None else tpot_at,
    )


@dataclass(frozen=True)
class CounterStep:
    """A counter's increase between two consecutive up snapshots of one instance."""

    instance: str
    start_ts: float
    end_ts: float
    increase: float


def counter_steps(
    session: Session, column: str, since: float, until: float, *, role: str | None = None
) -> list[CounterStep]:
    """Every positive step of a counter column (e.g. ``nixl_kv_expired_reqs``) in the window."""
    col = getattr(Snapshot, column)
    stmt = (
        select(Snapshot.instance, Snapshot.ts, col)
        .where(Snapshot.ts >= since, Snapshot.ts <= until, Snapshot.up.is_(True))
        .order_by(Snapshot.instance, Snapshot.ts)
    )
    if role is not None:
        stmt = stmt.where(Snapshot.role == role)
    steps: list[CounterStep] = []
    prev: tuple[str, float, float] | None = None
    for inst, ts, value in session.execute(stmt):
        if value is None:
            continue
        if prev is not None and prev[0] == inst:
            inc = value - prev[2] if value >= prev[2] else value
            if inc > 0:
                steps.append(CounterStep(inst, prev[1], ts, inc))
        prev = (inst, ts, value)
    return steps
