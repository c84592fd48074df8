"""Decision regret: what happened after each cut the controller made, and a tally per reason.

A *cut* is a stored decision that lowered a value the policy owns: an instance's ``weight`` or a
pool's ``max_inflight_requests`` (the one limit field stands for the pool's limits, which move
together; ``RegretConfig.cut_fields``). For every cut this module says what happened next:

* **recovered**: the first signal bucket after the cut in which the instance looked healthy again
  (:func:`healthy`: scraped up, KV usage under ``max_kv_usage``, and with at least
  ``min_requests`` requests through it: its failed share under ``max_failed_share`` and its own
  stage time within ``stage_tolerance`` × its peers' median). A cut for ``InstanceDown`` or
  ``KVCachePressure`` is judged on the scrape alone (a weight-0 instance gets no requests).
  Pools have no per-instance signals: ``None``.
* **SLO before / after**: the fleet's SLO attainment over ``slo_window_s`` before the cut and over
  as long after it, from :class:`SLOBucket` counts, and the difference (after − before).
* **undone**: the first later decision on the same subject and field whose new value is back at
  (or above) the value the cut started from, and after how many ticks. Tick numbers are compared
  only within one leader epoch (a restarted or replaced controller counts from 0 again); across
  epochs the ticks are the elapsed time over ``tick_s``. Undone within ``flap_ticks`` ticks is a
  *flap*.

The tally groups the cuts by reason: cuts, undone, flapped, the flapping rate (flapped over the
cuts whose ``flap_ticks`` have fully passed by ``observed_until`` or that were undone; the rest are
*pending*), median ticks and seconds to undo, recovered, and the mean SLO delta.

:func:`signal_samples` and :func:`slo_buckets` turn plain request and scrape facts into the bucketed
inputs, so the whole analysis is table-testable. Pure: no I/O, no clock (every time is passed in).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from statistics import median
from typing import Any, Final

from pdscope.reasons import Reason
from pdscope.semconv import FAILED_OUTCOMES

EPS: Final = 1e-9
SCRAPE_REASONS: Final = frozenset({Reason.INSTANCE_DOWN.value, Reason.KV_CACHE_PRESSURE.value})


@dataclass(frozen=True)
class DecisionFact:
    """One stored decision, as regret reads it (``store.models.Decision``'s fields of the same names;
    ``epoch`` is its ``leader_epoch``)."""

    ts: float
    tick: int
    subject_kind: str
    subject: str
    field: str
    old_value: float | None
    new_value: float | None
    reason: str
    epoch: int | None = None

    @property
    def is_cut(self) -> bool:
        return (
            self.old_value is not None
            and self.new_value is not None
            and self.new_value < self.old_value - EPS
        )


@dataclass(frozen=True)
class RecordFact:
    """One request record, as regret reads it. ``met``: it met every SLO (completed only)."""

    proxy_in: float
    status: str
    p_instance: str | None
    d_instance: str | None
    p_sent: float | None
    p_done: float | None
    d_sent: float | None
    first_token: float | None
    met: bool


@dataclass(frozen=True)
class ScrapeFact:
    """One scrape of one instance: was it up, and its KV usage (0..1)."""

    instance: str
    ts: float
    up: bool
    kv_usage: float | None


@dataclass(frozen=True)
class SignalSample:
    """One instance's signals over one bucket ``[start, end)``.

    ``stage_s`` is the median of its own stage over the requests through it (P: sent → prefill done;
    D: prefill done → first token, the handoff incl. the KV pull; sent to D → first token on the
    decode-only path), ``peer_stage_s`` the median of the same stage over the other instances in the
    same role in the bucket. ``failed``: its requests that failed (errors, timeouts) in its stage
    (before the request was sent to D: P's; after: D's, as the policy charges them). ``up``: every
    scrape in the bucket was up (None: not scraped), ``kv_usage`` the highest reading.
    """

    subject: str
    start: float
    end: float
    up: bool | None = None
    kv_usage: float | None = None
    requests: int = 0
    failed: int = 0
    stage_s: float | None = None
    peer_stage_s: float | None = None


@dataclass(frozen=True)
class SLOBucket:
    """The fleet's completed requests over ``[start, end)`` and how many met every SLO."""

    start: float
    end: float
    completed: int
    met: int


@dataclass(frozen=True)
class RegretConfig:
    """What counts as a flap, as recovered, and how far to look."""

    flap_ticks: int = 10
    tick_s: float = 2.0  # controller.interval_s: ticks from elapsed time where tick numbers do not compare
    slo_window_s: float = 300.0
    stage_tolerance: float = 1.5
    max_failed_share: float = 0.05
    max_kv_usage: float = 0.85
    min_requests: int = 5
    cut_fields: frozenset[str] = frozenset({"weight", "max_inflight_requests"})

    def __post_init__(self) -> None:
        if self.flap_ticks < 1:
            raise ValueError("flap_ticks: must be at least 1")
        if not self.tick_s > 0 or not self.slo_window_s > 0:
            raise ValueError("tick_s and slo_window_s: must be more than 0")


@dataclass(frozen=True)
class CutOutcome:
    """What followed one cut."""

    ts: float
    tick: int
    subject_kind: str
    subject: str
    field: str
    reason: str
    old_value: float
    new_value: float
    recovered_at: float | None = None  # end of the first healthy bucket after the cut
    slo_before: float | None = None
    slo_after: float | None = None
    undone_at: float | None = None
    undone_after_ticks: int | None = None
    undone_by: str | None = None  # the undoing decision's reason
    flapped: bool = False
    pending: bool = False  # not undone, and its flap_ticks have not all passed by observed_until

    @property
    def recovered_after_s(self) -> float | None:
        return None if self.recovered_at is None else max(0.0, self.recovered_at - self.ts)

    @property
    def undone_after_s(self) -> float | None:
        return None if self.undone_at is None else self.undone_at - self.ts

    @property
    def slo_delta(self) -> float | None:
        if self.slo_before is None or self.slo_after is None:
            return None
        return self.slo_after - self.slo_before

    def as_dict(self) -> dict[str, Any]:
        return {
            "ts": self.ts,
            "tick": self.tick,
            "subject_kind": self.subject_kind,
            "subject": self.subject,
            "field": self.field,
            "reason": self.reason,
            "old_value": self.old_value,
            "new_value": self.new_value,
            "recovered_at": self.recovered_at,
            "recovered_after_s": _round(self.recovered_after_s),
            "slo_before": _round(self.slo_before),
            "slo_after": _round(self.slo_after),
            "slo_delta": _round(self.slo_delta),
            "undone_at": self.undone_at,
            "undone_after_ticks": self.undone_after_ticks,
            "undone_after_s": _round(self.undone_after_s),
            "undone_by": self.undone_by,
            "flapped": self.flapped,
            "pending": self.pending,
        }


@dataclass(frozen=True)
class ReasonTally:
    """The cuts of one reason (``"*"``: all of them)."""

    reason: str
    cuts: int
    undone: int
    flapped: int
    pending: int
    recovered: int
    median_ticks_to_undo: float | None
    median_s_to_undo: float | None
    mean_slo_delta: float | None

    @property
    def flap_rate(self) -> float | None:
        decided = self.cuts - self.pending
        return self.flapped / decided if decided else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "cuts": self.cuts,
            "undone": self.undone,
            "flapped": self.flapped,
            "pending": self.pending,
            "flap_rate": _round(self.flap_rate),
            "recovered": self.recovered,
            "median_ticks_to_undo": self.median_ticks_to_undo,
            "median_s_to_undo": _round(self.median_s_to_undo),
            "mean_slo_delta": _round(self.mean_slo_delta),
        }


@dataclass(frozen=True)
class Regret:
    """Every cut of ``[since, until]`` with what followed, the tally per reason and over all."""

    since: float
    until: float
    observed_until: float
    flap_ticks: int
    cuts: tuple[CutOutcome, ...]
    reasons: tuple[ReasonTally, ...]
    total: ReasonTally

    def as_dict(self, max_cuts: int = 200) -> dict[str, Any]:
        return {
            "since": self.since,
            "until": self.until,
            "observed_until": self.observed_until,
            "flap_ticks": self.flap_ticks,
            "total": self.total.as_dict(),
            "reasons": [r.as_dict() for r in self.reasons],
            "cuts": [c.as_dict() for c in self.cuts[-max_cuts:] if max_cuts > 0],
            "cuts_listed": min(len(self.cuts), max(max_cuts, 0)),
        }


def _round(v: float | None, nd: int = 4) -> float | None:
    return None if v is None else round(v, nd)


# -- inputs from plain facts -------------------------------------------------------------------


def _bucket(ts: float, lo: float, width: float) -> int:
    return math.floor((ts - lo) / width)


def signal_samples(
    records: Iterable[RecordFact],
    scrapes: Iterable[ScrapeFact],
    lo: float,
    hi: float,
    bucket_s: float,
) -> tuple[SignalSample, ...]:
    """Per instance and bucket of ``bucket_s`` over ``[lo, hi)``: its :class:`SignalSample`."""
    if not bucket_s > 0:
        raise ValueError("bucket_s: must be more than 0")
    # (role, bucket) -> instance -> stage times; (instance, bucket) -> [requests, failed]
    stages: dict[tuple[str, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    counts: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])
    for r in records:
        if not lo <= r.proxy_in < hi:
            continue
        b = _bucket(r.proxy_in, lo, bucket_s)
        failed = r.status in FAILED_OUTCOMES  # errors and timeouts, as the policy charges them
        for role, inst, began, ended in (
            ("prefill", r.p_instance, r.p_sent, r.p_done),
            # the decode-only path has no prefill done: its D stage begins when it was sent to D
            ("decode", r.d_instance, r.p_done if r.p_done is not None else r.d_sent, r.first_token),
        ):
            if not inst:
                continue
            c = counts[(inst, b)]
            c[0] += 1
            mine = (role == "prefill") == (r.d_sent is None)  # D's once the decode stage began
            c[1] += int(failed and mine)
            if began is not None and ended is not None:
                stages[(role, b)][inst].append(max(0.0, ended - began))
    ups: dict[tuple[str, int], bool] = {}
    kvs: dict[tuple[str, int], float] = {}
    for s in scrapes:
        if not lo <= s.ts < hi:
            continue
        key = (s.instance, _bucket(s.ts, lo, bucket_s))
        ups[key] = ups.get(key, True) and s.up
        if s.kv_usage is not None:
            kvs[key] = max(kvs.get(key, s.kv_usage), s.kv_usage)
    own: dict[tuple[str, int], tuple[float, float | None]] = {}
    for (_, b), by_inst in stages.items():
        medians = {inst: median(v) for inst, v in by_inst.items()}
        for inst, m in medians.items():
            peers = [x for name, x in medians.items() if name != inst]
            own[(inst, b)] = (m, median(peers) if peers else None)
    out: list[SignalSample] = []
    for key in sorted(set(counts) | set(ups) | set(kvs), key=lambda k: (k[0], k[1])):
        inst, b = key
        n, n_failed = counts.get(key, [0, 0])
        stage, peer = own.get(key, (None, None))
        start = lo + b * bucket_s
        out.append(
            SignalSample(
                inst, start, min(hi, start + bucket_s), ups.get(key), kvs.get(key), n, n_failed, stage, peer
            )
        )
    return tuple(out)


def slo_buckets(
    records: Iterable[RecordFact], lo: float, hi: float, bucket_s: float
) -> tuple[SLOBucket, ...]:
    """The fleet's completed and SLO-meeting requests per bucket of ``bucket_s`` over ``[lo, hi)``."""
    if not bucket_s > 0:
        raise ValueError("bucket_s: must be more than 0")
    tally: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for r in records:
        if lo <= r.proxy_in < hi and r.status == "ok":
            t = tally[_bucket(r.proxy_in, lo, bucket_s)]
            t[0] += 1
            t[1] += int(r.met)
    return tuple(
        SLOBucket(lo + b * bucket_s, min(hi, lo + (b + 1) * bucket_s), c, m)
        for b, (c, m) in sorted(tally.items())
    )


# -- the analysis -------------------------------------------------------------------------------


def healthy(sample: SignalSample, reason: str, cfg: RegretConfig) -> bool | None:
    """Did the instance look healthy in this bucket? None: too little seen to say."""
    if sample.up is False:
        return False
    if sample.kv_usage is not None and sample.kv_usage > cfg.max_kv_usage:
        return False
    if reason in SCRAPE_REASONS:
        return True if sample.up else None
    if sample.requests < cfg.min_requests:
        return None
    if sample.failed / sample.requests > cfg.max_failed_share:
        return False
    if sample.stage_s is not None and sample.peer_stage_s is not None:
        return sample.stage_s <= cfg.stage_tolerance * sample.peer_stage_s + EPS
    return True


def ticks_between(a: DecisionFact, b: DecisionFact, tick_s: float) -> int:
    """Ticks from ``a`` to ``b``: tick numbers within one leader epoch, elapsed time over ``tick_s``
    across epochs (a new leader counts its ticks from 0)."""
    if a.epoch is not None and a.epoch == b.epoch and b.tick >= a.tick:
        return b.tick - a.tick
    return max(0, round((b.ts - a.ts) / tick_s))


def _attainment(buckets: Sequence[SLOBucket], lo: float, hi: float) -> float | None:
    done = met = 0
    for b in buckets:
        if lo <= (b.start + b.end) / 2 < hi:
            done, met = done + b.completed, met + b.met
    return met / done if done else None


def _outcome(
    cut: DecisionFact,
    later: Sequence[DecisionFact],
    samples: Sequence[SignalSample],
    slo: Sequence[SLOBucket],
    observed_until: float,
    cfg: RegretConfig,
) -> CutOutcome:
    assert cut.old_value is not None and cut.new_value is not None
    undo = next((d for d in later if d.new_value is not None and d.new_value >= cut.old_value - EPS), None)
    ticks = None if undo is None else ticks_between(cut, undo, cfg.tick_s)
    recovered = None
    if cut.subject_kind == "instance":
        recovered = next(
            (s.end for s in samples if s.start >= cut.ts - EPS and healthy(s, cut.reason, cfg) is True), None
        )
    horizon = cut.ts + cfg.flap_ticks * cfg.tick_s
    return CutOutcome(
        ts=cut.ts,
        tick=cut.tick,
        subject_kind=cut.subject_kind,
        subject=cut.subject,
        field=cut.field,
        reason=cut.reason,
        old_value=cut.old_value,
        new_value=cut.new_value,
        recovered_at=recovered,
        slo_before=_attainment(slo, cut.ts - cfg.slo_window_s, cut.ts),
        slo_after=_attainment(slo, cut.ts, cut.ts + cfg.slo_window_s),
        undone_at=None if undo is None else undo.ts,
        undone_after_ticks=ticks,
        undone_by=None if undo is None else undo.reason,
        flapped=ticks is not None and ticks <= cfg.flap_ticks,
        pending=undo is None and horizon > observed_until,
    )


def tally(reason: str, cuts: Sequence[CutOutcome]) -> ReasonTally:
    """The tally of ``cuts`` under the name ``reason``."""
    undone = [c for c in cuts if c.undone_at is not None]
    deltas = [d for c in cuts if (d := c.slo_delta) is not None]
    return ReasonTally(
        reason=reason,
        cuts=len(cuts),
        undone=len(undone),
        flapped=sum(1 for c in cuts if c.flapped),
        pending=sum(1 for c in cuts if c.pending),
        recovered=sum(1 for c in cuts if c.recovered_at is not None),
        median_ticks_to_undo=median(c.undone_after_ticks or 0 for c in undone) if undone else None,
        median_s_to_undo=median(c.undone_after_s or 0.0 for c in undone) if undone else None,
        mean_slo_delta=sum(deltas) / len(deltas) if deltas else None,
    )


def regret(
    decisions: Iterable[DecisionFact],
    samples: Iterable[SignalSample],
    slo: Iterable[SLOBucket],
    *,
    since: float,
    until: float,
    observed_until: float,
    cfg: RegretConfig | None = None,
) -> Regret:
    """What followed every cut taken in ``[since, until]``.

    ``decisions`` must hold every decision of the cut fields from ``since`` on (later ones are what
    undoes a cut; their order is by ``ts`` then as given), ``samples`` the cut instances' signals
    after the cuts and ``slo`` the fleet's buckets around them; ``observed_until`` is how far the data
    goes (a cut whose ``flap_ticks`` reach past it and that is not undone is *pending*). Never raises
    on data; a bad ``cfg`` raises ``ValueError`` when built."""
    cfg = cfg or RegretConfig()
    ordered = sorted(
        (d for d in decisions if d.field in cfg.cut_fields), key=lambda d: d.ts
    )  # stable: ties keep their given (id) order
    by_subject: dict[tuple[str, str, str], list[DecisionFact]] = defaultdict(list)
    for d in ordered:
        by_subject[(d.subject_kind, d.subject, d.field)].append(d)
    by_instance: dict[str, list[SignalSample]] = defaultdict(list)
    for s in sorted(samples, key=lambda s: s.start):
        by_instance[s.subject].append(s)
    slo_list = sorted(slo, key=lambda b: b.start)
    out: list[CutOutcome] = []
    for key, history in by_subject.items():
        for i, d in enumerate(history):
            if d.is_cut and since <= d.ts <= until:
                out.append(
                    _outcome(d, history[i + 1 :], by_instance.get(key[1], []), slo_list, observed_until, cfg)
                )
    out.sort(key=lambda c: (c.ts, c.subject, c.field))
    grouped: Mapping[str, list[CutOutcome]] = _group(out)
    reasons = tuple(sorted((tally(r, cs) for r, cs in grouped.items()), key=lambda t: (-t.cuts, t.reason)))
    return Regret(since, until, observed_until, cfg.flap_ticks, tuple(out), reasons, tally("*", out))


@dataclass(frozen=True)
class ReadPlan:
    """What to read for the cuts of ``[since, until]``: decisions from ``since`` on, records over
    ``[records_from, data_until]``, the cut instances' scrapes over ``[since, data_until]``; signals
    bucketed by ``bucket_s``, the SLO by the finer ``slo_bucket_s`` (a tick), so the requests just
    before a cut count before it."""

    since: float
    until: float
    records_from: float
    data_until: float
    bucket_s: float
    slo_bucket_s: float


LOOKAHEAD_S: Final = 3600.0  # how long after the range's end a cut's recovery is looked for
MIN_BUCKET_S: Final = 30.0
MAX_BUCKETS: Final = 1000  # per instance
MAX_SLO_BUCKETS: Final = 20_000


def plan(since: float, until: float, now: float, cfg: RegretConfig) -> ReadPlan:
    """The reads for the cuts of ``[since, until]`` with data up to ``now``: the SLO window before the
    first cut, up to :data:`LOOKAHEAD_S` (at least the SLO window and ``flap_ticks``) after the last;
    signal buckets of at least :data:`MIN_BUCKET_S` and at most :data:`MAX_BUCKETS` of them, SLO
    buckets of a tick, at most :data:`MAX_SLO_BUCKETS`."""
    ahead = max(LOOKAHEAD_S, cfg.slo_window_s, cfg.flap_ticks * cfg.tick_s)
    lo = since - cfg.slo_window_s
    hi = max(until, min(now, until + ahead))
    span = hi - lo
    return ReadPlan(
        since, until, lo, hi, max(MIN_BUCKET_S, span / MAX_BUCKETS), max(cfg.tick_s, span / MAX_SLO_BUCKETS)
    )


def cut_instances(decisions: Iterable[DecisionFact], since: float, until: float) -> frozenset[str]:
    """The instances with a weight cut in ``[since, until]`` (whose scrapes the signals need)."""
    return frozenset(
        d.subject for d in decisions if d.subject_kind == "instance" and d.is_cut and since <= d.ts <= until
    )


def regret_of(
    p: ReadPlan,
    decisions: Sequence[DecisionFact],
    records: Sequence[RecordFact],
    scrapes: Sequence[ScrapeFact],
    *,
    observed_until: float,
    cfg: RegretConfig,
) -> Regret:
    """:func:`regret` over what ``p`` read, bucketed as it says."""
    end = p.data_until + EPS  # the last record and scrape of the range fall in the last bucket
    return regret(
        decisions,
        signal_samples(records, scrapes, p.since, end, p.bucket_s),
        slo_buckets(records, p.records_from, end, p.slo_bucket_s),
        since=p.since,
        until=p.until,
        observed_until=observed_until,
        cfg=cfg,
    )


def _group(cuts: Iterable[CutOutcome]) -> dict[str, list[CutOutcome]]:
    grouped: dict[str, list[CutOutcome]] = defaultdict(list)
    for c in cuts:
        grouped[c.reason].append(c)
    return grouped


__all__ = [
    "CutOutcome",
    "DecisionFact",
    "ReadPlan",
    "ReasonTally",
    "RecordFact",
    "Regret",
    "RegretConfig",
    "SLOBucket",
    "ScrapeFact",
    "SignalSample",
    "cut_instances",
    "healthy",
    "plan",
    "regret",
    "regret_of",
    "signal_samples",
    "slo_buckets",
    "tally",
    "ticks_between",
]
