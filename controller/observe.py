"""Read a recent window from the store into one frozen :class:`Observation`.

This is the controller's only reader of snapshots and request records. It reads: the
window's snapshots (one query; their counter increases with resets and the latest gauges
through ``store.queries``), the request records the controller believes, the handoff
percentiles over them and the SLO summary, and with ``tenants.enabled`` each declared tenant's
figures over ``slo.window_s`` (``controller.tenants``, the same believed records). What those
figures say, and about whom (which instance a failure or an expired lease is charged to, Little's
law, the typical member, the lower median over the P×D pairs, coverage and sample minimums), is the pure
``controller.policy.evidence``.

What it believes: with ``controller.trusted_span_senders`` set, only request records whose
``sender`` is in that list (the rest are counted, ``Observation.untrusted_records``).

The same read of the records gives the served records' facts the rates' fit reads
(``analysis.rates``, on request: ``observe(..., rate_facts=[])``); they are no part of the
``Observation``: the rates are served beside the table, not decided on.

It reads; it never writes and never decides. Errors from the database surface as
``store.StoreError`` through ``store.transaction`` in the caller.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from analysis import rates
from analysis.prediction import PredictionFacts, measure
from analysis.stranded import to_pull
from analysis.tenants import TenantWindow
from controller.evidencerows import facts_of, served_facts
from controller.handoffgroups import BYS
from controller.kept import KeptReads, PairMemo
from controller.policy import evidence as ev
from controller.policy.charges import RecordFacts
from controller.policy.config import EvidenceConfig, PolicyConfig
from controller.policy.signals import InstanceSignals, Observation, PairSignals, SLOFigures
from controller.slowindow import WindowFigures
from controller.tenants import read_tenants
from pdscope.config import Settings
from pdscope.kvcompat import FIELDS, MALFORMED, identity
from pdscope.stats import counter_increase
from store import queries as q
from store.attribution import trusted_records
from store.models import UNREACHABLE, InstanceRow, RequestRecord, Snapshot
from store.prediction import DEFAULT_RECORDS, prediction_rows
from store.tenants import DEFAULT_RECORDS as TENANT_RECORDS


def _latest_gauges(
    rows_by_instance: dict[str, list[Any]], since: float, until: float
) -> dict[str, ev.LatestGauges]:
    """Per instance: the latest KV-fetch gauges, the mean queue time over the window's rows, how long
    its trailing run of failed scrapes has lasted (no up scrape in the window: since the window began),
    and how many of that run's last scrapes in a row found nothing listening."""
    out: dict[str, ev.LatestGauges] = {}
    for inst, rows in rows_by_instance.items():
        up_rows = [r for r in rows if r.up]
        down_since: float | None = None
        for r in reversed(rows):  # the first of the trailing run of down scrapes
            if r.up:
                break
            down_since = r.ts
        down_for = None if down_since is None else max(0.0, until - (since if not up_rows else down_since))
        if not up_rows:
            out[inst] = ev.LatestGauges(None, None, down_for, unreachable=_unreachable_run(rows))
            continue
        last = up_rows[-1]
        at_d = (last.kv_fetch_waiting_to_start, last.kv_fetch_completed_waiting)  # not pulling: waiting at D
        waits = [v for v in at_d if v is not None]
        parts = waits + ([last.kv_fetch_in_progress] if last.kv_fetch_in_progress is not None else [])
        qsum = counter_increase(r.queue_sum for r in up_rows)
        qcnt = counter_increase(r.queue_count for r in up_rows)
        out[inst] = ev.LatestGauges(
            sum(parts) if parts else None,
            qsum / qcnt if qsum is not None and qcnt else None,
            down_for,
            sum(waits) if waits else None,
            _unreachable_run(rows),
            to_pull(last.kv_fetch_waiting_to_start, last.kv_fetch_in_progress),
        )
    return out


def _unreachable_run(rows: list[Any]) -> int:
    """How many of the latest scrapes in a row could not connect (:data:`store.models.UNREACHABLE`)."""
    n = 0
    for r in reversed(rows):
        if r.up or not (r.error or "").startswith(UNREACHABLE):
            break
        n += 1
    return n


# the columns of ev.RecordFacts, in its order, then those the rates' fit reads besides (rates.EXTRA_FIELDS)
_RECORD_COLUMNS = tuple(getattr(RequestRecord, name) for name in RecordFacts._fields)
_FACTS = len(_RECORD_COLUMNS)
_RATE_COLUMNS = tuple(getattr(RequestRecord, name) for name in rates.EXTRA_FIELDS)


def _records(
    session: Session, since: float, until: float, only: q.RecordFilter, rated: bool
) -> Iterable[Any]:
    """The window's records' facts, and (``rated``) the columns the rates' fit reads besides: only a tick
    that fits reads them (they are most of what the fit adds to this read)."""
    columns = (*_RECORD_COLUMNS, *_RATE_COLUMNS) if rated else _RECORD_COLUMNS
    stmt = select(*columns).where(RequestRecord.proxy_in >= since, RequestRecord.proxy_in <= until)
    # in (arrival, id) order, as the window kept between ticks lays them out (controller.evidencerows)
    stmt = stmt.order_by(RequestRecord.proxy_in, RequestRecord.id)
    return session.connection().execute(only.apply(stmt)).all()  # Core rows at once


def _tally(
    session: Session,
    settings: Settings,
    since: float,
    now: float,
    trusted: q.RecordFilter,
    rate_facts: list[rates.RateFacts] | None,
    kept: KeptReads | None = None,
) -> ev.WindowTally:
    """The window's records, charged; each served one's rate facts appended to ``rate_facts`` (if given).
    ``kept``: the records and their charges kept between ticks (``controller.evidencerows``), else read
    whole."""
    pools = {name: p.role for name, p in settings.pools.items()}
    restarted = _restarts(session)  # before the records on both paths: one order for a restart in between
    if kept is not None:
        rows = kept.evidence(session, settings, since, now)
        if rate_facts is not None:
            rate_facts.extend(rows.rate_facts())
        return rows.tally(pools, restarted)
    tally = ev.WindowTally(pools, now, restarted)
    for row in _records(session, since, now, trusted, rated=rate_facts is not None):
        r, invalid = facts_of(row[:_FACTS])
        tally.add(r, invalid)
        if rate_facts is not None and (facts := served_facts(r, row[_FACTS:])) is not None:
            rate_facts.append(facts)
    return tally


def _restarts(session: Session) -> dict[str, float]:
    """Each instance's latest restart the collector confirmed (``InstanceRow.restarted_at``)."""
    stmt = select(InstanceRow.name, InstanceRow.restarted_at).where(InstanceRow.restarted_at.is_not(None))
    return {name: float(at) for name, at in session.execute(stmt) if at is not None}


def _identities(session: Session) -> dict[str, dict[str, str]]:
    """Each instance's identity as the collector last stored it (``InstanceRow.kv_identity``); a stored
    value that is not an object of strings reads as reporting nothing valid (every field malformed)."""
    out: dict[str, dict[str, str]] = {}
    for name, found in session.execute(select(InstanceRow.name, InstanceRow.kv_identity)):
        if isinstance(found, dict):
            out[name] = {str(k): v if isinstance(v, str) else MALFORMED for k, v in found.items()}
        elif found is not None:
            out[name] = dict.fromkeys(FIELDS[:3], MALFORMED)
    return out


def _failed_attempts(session: Session, since: float, until: float, only: q.RecordFilter) -> Iterable[object]:
    """The failed attempts retried records carry (``attributes["failed_attempts"]``)."""
    stmt = select(RequestRecord.attributes).where(
        RequestRecord.proxy_in >= since, RequestRecord.proxy_in <= until, RequestRecord.retries > 0
    )
    for (attrs,) in session.execute(only.apply(stmt)):
        yield from (attrs or {}).get("failed_attempts") or [] if isinstance(attrs, dict) else []


def lease_suspects_query(since: float, until: float) -> Select[*tuple[Any, ...]]:
    """The lease-expiry suspects that arrived in ``[since, until]``: a few among every record there, read
    through their own partial index (``ix_request_records_lease_suspects``), whose predicate is this
    query's term ``lease_expiry_suspect IS true`` as each dialect writes it."""
    return select(
        RequestRecord.d_instance,
        RequestRecord.done,
        RequestRecord.proxy_in,
        RequestRecord.attributes,
        RequestRecord.status,
        RequestRecord.http_status,
    ).where(
        RequestRecord.proxy_in >= since,
        RequestRecord.proxy_in <= until,
        RequestRecord.lease_expiry_suspect.is_(True),
    )


def _lease_suspects(
    session: Session, since: float, until: float, lookback_s: float, only: q.RecordFilter
) -> Iterable[tuple[object, float | None, object, bool]]:
    """``(d_instance, ended at, attributed expiries, refused as the client's error)`` of the lease-expiry
    suspects that may count now."""
    for d_inst, done, t_in, attrs, status, http in session.execute(
        only.apply(lease_suspects_query(since - lookback_s, until))
    ):
        at = done if isinstance(done, float) else t_in if isinstance(t_in, float) else None
        invalid = q.is_client_error(status, http)
        yield d_inst, at, attrs.get("lease_expiry") if isinstance(attrs, dict) else None, invalid


def trusted_filter(settings: Settings) -> q.RecordFilter:
    """The records the controller believes (``controller.trusted_span_senders``)."""
    return trusted_records(settings.controller.trusted_span_senders)


def _slo(
    session: Session, settings: Settings, now: float, only: q.RecordFilter, kept: KeptReads | None = None
) -> SLOFigures:
    window = settings.slo.window_s
    got = kept.slo(session, settings, now) if kept is not None else _whole_slo(session, settings, now, only)
    # the proxy's TTFT predictor over the same records (the TTFTMispredicted alert): kept with the window
    kept_prediction = kept.prediction(DEFAULT_RECORDS) if kept is not None else None
    measured, error = kept_prediction or _whole_prediction(session, now - window, now, only)
    if got is None:
        return SLOFigures(window_s=window, predictions=measured, prediction_error_p50=error)
    return SLOFigures(
        window_s=window,
        predictions=measured,
        prediction_error_p50=error,
        completed=got.completed,
        met=got.met,
        rejected=got.statuses.get("rejected", 0),
        ttft_at_slo_s=got.ttft_at_slo_s,
        tpot_at_slo_s=got.tpot_at_slo_s,
        goodput_rps=got.goodput_per_s,
    )


def _whole_prediction(
    session: Session, since: float, until: float, only: q.RecordFilter
) -> tuple[int, float | None]:
    """The TTFT predictor's fleet figures read whole: how many measured, the errors' median."""
    fleet = measure(PredictionFacts(*r) for r in prediction_rows(session, since, until, only=only).rows).fleet
    return fleet.measured, fleet.error_p50


def _whole_slo(
    session: Session, settings: Settings, now: float, only: q.RecordFilter
) -> WindowFigures | None:
    """The SLO window read whole (what :class:`controller.kept.KeptReads` keeps between ticks instead)."""
    summary = q.slo_summary(
        session,
        now - settings.slo.window_s,
        now,
        only=only,
        slo_percentiles=(settings.slo.ttft.percentile, settings.slo.tpot.percentile),
        slo=settings.slo,
    ).get("all")
    if summary is None:
        return None
    return WindowFigures(
        summary.requests,
        summary.completed,
        summary.slo_met,
        {k: n for k, n in summary.statuses.items()},
        summary.ttft_at_slo_s,
        summary.tpot_at_slo_s,
        summary.goodput_per_s,
    )


def _charged(
    session: Session,
    settings: Settings,
    evc: EvidenceConfig,
    since: float,
    now: float,
    rate_facts: list[rates.RateFacts] | None,
    kept: KeptReads | None = None,
) -> ev.WindowTally:
    """The window's trusted records tallied, then charged their failed attempts and lease expiries."""
    trusted = trusted_filter(settings)
    tally = _tally(session, settings, since, now, trusted, rate_facts, kept)
    tally.charge_failed_attempts(_failed_attempts(session, since, now, replace(trusted, charged_only=True)))
    # Every trusted suspect: one D refused as the client's error explains its P's expiry, charging nobody.
    for d_inst, ended, entries, invalid in _lease_suspects(
        session, since, now, evc.lease_lookback * evc.kv_lease_s, trusted
    ):
        tally.charge_lease_expiries(d_inst, ended, entries, since, now, invalid)
    return tally


def _instances(
    session: Session,
    settings: Settings,
    evc: EvidenceConfig,
    span: tuple[float, float],
    snaps: dict[str, list[Any]],
    tally: ev.WindowTally,
    hand: dict[q.HandoffKey, dict[str, q.HandoffStats]],
    kept: KeptReads | None,
) -> tuple[list[InstanceSignals], float | None]:
    """Every configured instance's signals from the window's snapshots (``snaps``, read before the tally)
    and its charged records, and the newest data seen (the newest snapshot stored, when no instance has one
    in the window). ``kept``: with the scrape figures of the window and its tail kept between ticks."""
    since, now = span
    window_memo, recent_memo = kept.scrape_figures if kept is not None else (None, None)
    sigs = q.signals_of_rows(snaps, memo=window_memo)
    recent = q.signals_of_rows(snaps, since=now - evc.recent_s, memo=recent_memo)
    latest = _latest_gauges(snaps, since, now)
    instances: list[InstanceSignals] = []
    newest: float | None = None
    stored = _identities(session)
    for pool_name, inst in settings.instances():
        role = settings.pools[pool_name].role
        kv_identity = None
        if (found := stored.get(inst.name)) is not None:
            revision = inst.revision or settings.pools[pool_name].revision
            kv_identity = identity({**found, **({"revision": revision} if revision is not None else {})})
        instances.append(
            ev.instance_signals(
                inst.name,
                pool_name,
                role,
                evc,
                sigs.get(inst.name),
                recent.get(inst.name),
                latest.get(inst.name),
                tally.instances.get(inst.name),
                hand["d_instance" if role == "decode" else "p_instance"].get(inst.name),
                tally.restarted.get(inst.name),
                kv_identity,
            )
        )
        if (s := sigs.get(inst.name)) is not None:
            newest = s.last_ts if newest is None else max(newest, s.last_ts)
    if newest is None:
        newest = session.scalar(select(func.max(Snapshot.ts)))
    return instances, newest


def _handoffs(tally: ev.WindowTally, kept: KeptReads | None) -> dict[q.HandoffKey, dict[str, q.HandoffStats]]:
    """The handoff percentiles per D, P and pair over the window's charged handoffs: kept between ticks with
    them (``controller.handoffgroups``, each group's until it changes), else taken from the tally's."""
    rows = kept.evidence_window.rows if kept is not None else None
    if rows is not None:
        return rows.handoffs.stats()
    return q.handoff_stats_of(tally.charged_handoffs, BYS)


def _recent_pairs(tally: ev.WindowTally, since: float) -> dict[str, q.HandoffStats]:
    """Per ``"P->D"``: the charged handoffs whose first token came at or after ``since``."""
    rows = [r for r in tally.charged_handoffs if isinstance(r.first_token, float) and r.first_token >= since]
    return q.handoff_stats_of(rows, ("pair",))["pair"]


_NO_REST = (0, 0, None, 0, 0)  # a pair's figures besides its handoffs' where it has none of them


def _pairs(
    pairs: dict[str, q.HandoffStats],
    failures: Mapping[tuple[str, str], int],
    recent: Mapping[str, q.HandoffStats] | None = None,
    tally: ev.WindowTally | None = None,
    memo: PairMemo | None = None,
) -> tuple[PairSignals, ...]:
    """The P×D pairs that carried a charged handoff, or failed one, in the window, by name; with the
    ``recent`` handoffs of each (:func:`_recent_pairs`) and (from ``tally``) those failed and served
    since P's latest restart. ``memo``: each pair's signals of the last tick with it (and what they were
    made of), the very same object again where its handoff figures are the same object (kept until its
    handoffs change, ``controller.handoffgroups``) and the rest equal; replaced by this tick's."""
    rests = _pair_rests(failures, recent or {}, tally)
    stats: dict[tuple[str, str], q.HandoffStats] = {}
    for key, hs in pairs.items():
        if hs.requests:
            p, _, d = key.partition("->")
            stats[p, d] = hs
    last = memo or {}
    made: PairMemo = {}
    out = []
    for pd in sorted(stats.keys() | {k for k, n in failures.items() if n}):
        found, rest = stats.get(pd), rests.get(pd, _NO_REST)
        kept = last.get(pd)
        if kept is not None and kept[0] is found and kept[1] == rest:
            signals = kept[2]
        else:
            handoffs = (found.requests, found.p50_s or 0.0, found.p99_s or 0.0) if found else (0, 0.0, 0.0)
            signals = PairSignals(pd[0], pd[1], *handoffs, *rest)
        made[pd] = (found, rest, signals)
        out.append(signals)
    if memo is not None:
        memo.clear()
        memo.update(made)
    return tuple(out)


def _pair_rests(
    failures: Mapping[tuple[str, str], int],
    recent: Mapping[str, q.HandoffStats],
    tally: ev.WindowTally | None,
) -> dict[tuple[str, str], tuple[Any, ...]]:
    """A pair's figures besides its handoffs' (failures, recent handoffs and their p50, failed and served
    since P's restart), for the pairs with any: the others' are :data:`_NO_REST`. Worked out for those few
    rather than looked up four times for each of the window's pairs."""
    failed = tally.failed_since_restart if tally is not None else {}
    served = tally.served_since_restart if tally is not None else {}
    now: dict[tuple[str, str], q.HandoffStats] = {}
    for key, hs in recent.items():
        p, _, d = key.partition("->")
        now[p, d] = hs
    out = {}
    for pd in failures.keys() | failed.keys() | served.keys() | now.keys():
        got = now.get(pd)
        out[pd] = (
            failures.get(pd, 0),
            got.requests if got is not None else 0,
            got.p50_s if got is not None else None,
            failed.get(pd, 0),
            served.get(pd, 0),
        )
    return out


def _pair_signals(
    hand: dict[q.HandoffKey, dict[str, q.HandoffStats]],
    tally: ev.WindowTally,
    recent: float,
    kept: KeptReads | None,
) -> tuple[PairSignals, ...]:
    """The pairs' signals (:func:`_pairs`), their recent handoffs those since ``recent``; with the memo
    ``kept`` between ticks, if any."""
    memo = kept.pair_signals if kept is not None else None
    return _pairs(hand["pair"], tally.pair_failures, _recent_pairs(tally, recent), tally, memo)


def _history_s(session: Session, now: float) -> float:
    """How long the store has watched the fleet: since its first snapshot (retention keeps the newest; by
    then the start-up is long over). A window that holds any of the start-up is a start-up window."""
    first_ever = session.scalar(select(func.min(Snapshot.ts)))
    return max(0.0, now - first_ever) if first_ever is not None else 0.0


def _snapshots(session: Session, window: float, now: float, kept: KeptReads | None) -> dict[str, list[Any]]:
    """The window's snapshots, one read for the window, its tail and the latest gauges: kept between the
    leader's ticks (only those stored since the last are read), else read whole."""
    if kept is not None:
        return kept.snapshots(session, window, now)
    return q.snapshot_window(session, now - window, now)


def observe(
    session: Session,
    settings: Settings,
    now: float,
    window_s: float | None = None,
    cfg: PolicyConfig | None = None,
    rate_facts: list[rates.RateFacts] | None = None,
    kept: KeptReads | None = None,
) -> Observation:
    """Everything one tick needs, for every configured instance (unscraped ones have ``up=None``).

    ``rate_facts``: where to append the served records' facts the rates' fit reads
    (:mod:`analysis.rates`), from the same read of the window's records; they are no part of the
    observation (the rates are not a decision). None: the read leaves out the columns only the fit needs.

    ``kept``: the reads kept between this leader's ticks (:mod:`controller.kept`: every window it reads is
    then read as what changed since the last tick); None: read whole, with the same figures."""
    evc = (cfg or PolicyConfig.from_settings(settings)).evidence
    window = window_s if window_s is not None else settings.controller.window_s
    since = now - window
    # The snapshots first, then the restarts (in the tally): a round committed between the two reads (a
    # restarted P's first up scrape and its restart) reads as P down and restarted, both fresh; the other
    # order read P up and not restarted, and charged D the pulls P's outage failed (a CI run of stop 45).
    snaps = _snapshots(session, window, now, kept)
    tally = _charged(session, settings, evc, since, now, rate_facts, kept)
    hand = _handoffs(tally, kept)
    instances, newest = _instances(session, settings, evc, (since, now), snaps, tally, hand, kept)
    rate_span = ev.rate_span_s(window, since, tally.first_in, now, evc)
    pcts = ev.PairPercentiles.of(tally, evc)
    pool_sigs = tuple(
        ev.pool_signals(name, agg, [i for i in instances if i.pool == name], tally, rate_span, evc, pcts)
        for name, agg in tally.pools.items()
    )
    trusted = trusted_filter(settings)
    slo = replace(_slo(session, settings, now, trusted, kept), handoff_p99_s=ev.fleet_handoff_p99(tally))
    return Observation(
        now=now,
        window_s=window,
        instances=tuple(instances),
        pools=pool_sigs,
        pairs=_pair_signals(hand, tally, now - evc.handoff_recent_s, kept),
        slo=slo,
        newest_data=newest,
        records_until=tally.last_in,
        untrusted_records=q.untrusted_records(session, since, now, trusted.senders),
        history_s=_history_s(session, now),
        unattributed_lease_expiries=sum(i.unattributed_lease_expiries for i in instances),
        tenants=_tenants(session, settings, now, kept),
    )


def _tenants(session: Session, settings: Settings, now: float, kept: KeptReads | None) -> TenantWindow | None:
    """Each declared tenant's figures over ``slo.window_s`` (the tenant alerts and metrics), from the rows
    ``kept`` between ticks if given; None while tenants are off (every request is ``default``'s: the
    fleet's own figures say it all)."""
    if not settings.tenants.enabled:
        return None
    if kept is None:
        return read_tenants(session, settings, now - settings.slo.window_s, now).window
    return kept.tenant_figures(session, settings, now, TENANT_RECORDS).window
