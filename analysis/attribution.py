"""SLO-miss attribution: why the requests of a window missed their SLO, in stages, places and causes.

Every request record is cut into the stages it went through, from its stored timestamps and
in-vLLM durations::

    admission  proxy_in -> p_sent (d_sent on the decode-only path): waiting for admission at the proxy
    retry      the same span instead of admission when failed attempts came before the record's
               own path (a new prefill after a failed handoff, another P): their time (below)
    p_queue    P's queue (vLLM's ``time_in_queue``, ``p_queue_s``)
    prefill    P's time not queued: p_done - p_sent - p_queue_s
    handoff    p_done -> first token: D's wait incl. the KV pull (vLLM counts the pull in D's queue
               time, so one request cannot split the two; see ``d_queue`` below)
    d_queue    the decode-only path's d_sent -> first token (no pull there), and handoff excess a D
               shows on the handoffs of every P alike (below)
    decode     (tpot - baseline tpot) x (completion tokens - 1)

A request *missed* when its verdict under the SLO settings (:func:`pdscope.slo.slo_verdict`) is not
met. Its excess is counted only over the stages that make up what it missed: the TTFT stages
(admission .. handoff) for a missed TTFT, decode for a missed TPOT, all of them for a failed
request. A stage's excess is its duration over the same stage's *baseline*: the median over the
window's healthy requests (those that met every SLO) where that stage was measured (``retry``'s
is admission's).

* **No healthy request** (every request missed): the baselines are zero, so a miss's excess is the
  whole of each stage; the result says so (``baseline_source``).
* **Noise.** Every stage varies about its median: in one miss, a stage whose excess is under
  :data:`NOISE_SHARE` (5%) of that miss's excess is not charged.
* **Unsampled records** (the proxy's root span only: no in-vLLM durations): P's queue and prefill
  are not split; the whole P time is compared with the healthy P time and charged to ``prefill``
  (``split: false`` on that stage). A stage whose timestamps are missing is not measured and
  charges nothing; a miss with no measured stage is still counted, under ``outcome`` for a failed
  request, else ``unmeasured``.
* **A failed request** ended in the stage it did not finish: prefill (no P answer), the handoff
  (no token; it waited there until it ended, ``done``), else decode. It counts at least
  ``failure_s`` of excess (default: the TTFT target; it gave no answer in time), what its measured
  stages leave charged to that stage, so failures that fail fast are not lost among slow misses.

Each stage's excess is charged to a place and a cause: admission to the proxy, P queue and prefill
to the P, handoff to the P×D pair, D queue and decode to the D. The cause is ``lease_expired``
(``lease_expiry_suspect``, its expired lease waiting on this D) or ``transfer_failed`` (a NIXL
failure on the D during the handoff) for a handoff, else ``failed:<error>`` for the stage a failed
request ended in, ``retried`` for a request the proxy retried, else ``slow``.

**Failed attempts** (a retried request: the collector's ``failed_attempts``; its record keeps the
last attempt's P and D): the ``retry`` span over admission's baseline, and the part of a handoff a
decode attempt passed on to the next D took, are charged as ``retry`` to those attempts, split by
their durations: a decode attempt to its pair (the P whose blocks it was to pull -> its D), a
prefill attempt to its P; the cause ``lease_expired`` (forensics named its D), ``transfer_failed``
(its D counted NIXL failures while it ran) or ``failed:<the proxy's error kind>``.

**Link, D or D queue:** the misses with pair-charged excess of one kind (a slow handoff, or one
cause) on one D (handoffs, failed attempts) that came through one P only are that link. Over several
P's, a pair *holds* its own (a bad link) when it has more of them than chance gives a pair of its
requests, were the misses drawn at random from all the D's (Fisher's exact test, one-sided, times the
number of pairs, under 1 %), at :data:`LINK_RATE_RATIO` times the other pairs' miss rate or more; a pair
whose P is not known holds nothing. A D's slow handoffs are judged so by its slow handoffs, not its
misses (:func:`slow_handoffs`: every served request's, over :data:`SLOW_HANDOFF` times the median of the
D's met ones), and on one pair only are that pair's where it handed off slow :data:`LINK_RATE_RATIO`
times as often as the others. The misses left beside the pairs that hold theirs are the D's: a
slow handoff is charged to ``*->D`` (every link into the D: its
NIC) when the D's KV pulls were slow (the median, over those handoffs, of the D's mean NIXL
transfer time in the scrape window of each is at least :data:`SLOW_TRANSFER_RATIO` times the
healthy requests'), else to the D's queue (``d_queue`` on the D); a failed attempt, or a flagged or
failed handoff, to ``*->D``. Read along a P's row, where no D's rule applies: a P's misses of one kind
spread over the pairs of several D's are charged to ``P->*`` (every link out of the P: its NIC).

Misses are grouped by (stage, place, cause); a group's share is its part of the window's total
excess (of its count, when no miss has any excess), and its ``since`` the first miss in it. The
groups are sorted by share, then count; the first three are "the top reasons we missed", each
with a sentence saying what it is.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from statistics import median
from typing import Any, Final, Literal

from pdscope.config import SLOSettings
from pdscope.slo import slo_verdict
from pdscope.stats import percentile_of_sorted

Stage = Literal[
    "admission", "retry", "p_queue", "prefill", "handoff", "d_queue", "decode", "outcome", "unmeasured"
]
# "slow" | "lease_expired" | "transfer_failed" | "failed:<error kind>" | "retried" | "status:<status>"
# | "unknown"
Cause = str

STAGE_LABELS: Final[dict[str, str]] = {
    "admission": "admission wait",
    "retry": "failed attempts",
    "p_queue": "P queue",
    "prefill": "prefill",
    "handoff": "handoff (incl. KV pull)",
    "d_queue": "D queue",
    "decode": "decode",
    "outcome": "failed requests",
    "unmeasured": "unmeasured stages",
}
TTFT_STAGES: Final = ("admission", "p_queue", "prefill", "handoff", "d_queue")
# internal baseline keys besides the stages: P's whole time (for unsampled records), TPOT per token,
# the D's mean NIXL transfer time over the handoff
P_TOTAL: Final = "p_total"
TPOT: Final = "tpot"
TRANSFER: Final = "transfer"
TOP_N: Final = 3
PROXY: Final = "proxy"
EVERY_P: Final = "*"  # a place "*->decode-1": every link into decode-1
EVERY_D: Final = "*"  # a place "prefill-0->*": every link out of prefill-0 (its NIC, its KV reads)
# a stage whose excess is under this share of its miss's excess is noise (every stage varies about its median)
NOISE_SHARE: Final = 0.05
# a D's KV pulls are slow when they take this many times the healthy requests' (its NIC, its links)
SLOW_TRANSFER_RATIO: Final = 3.0


@dataclass(frozen=True, slots=True)
class Attempt:
    """A failed attempt of a retried request (the collector's ``failed_attempts``): not the record's own."""

    stage: str  # "prefill" | "decode"
    instance: str
    kind: str  # the proxy's error kind: timeout, connect, status_500, stream_error, ...
    start: float
    end: float
    p_instance: str | None = None  # a decode attempt: the P whose blocks it was to pull
    transfer_failed: bool = False  # its D counted NIXL failures while it ran


@dataclass(frozen=True, slots=True)
class StageRecord:
    """What attribution reads of one request record (``store.models.RequestRecord``'s columns)."""

    request_id: str
    proxy_in: float
    status: str
    p_instance: str | None = None
    d_instance: str | None = None
    p_sent: float | None = None
    p_done: float | None = None
    d_sent: float | None = None
    first_token: float | None = None
    done: float | None = None
    p_queue_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    completion_tokens: int | None = None
    lease_expired: bool = False
    transfer_failed: bool = False
    retries: int = 0
    lease_expired_ds: tuple[str, ...] = ()  # the D's its expired leases were waiting on (forensics)
    attempts: tuple[Attempt, ...] = ()  # its failed attempts, oldest first
    transfer_s: float | None = None  # the D's mean NIXL transfer time over the handoff (forensics)
    error: str | None = None  # the proxy's error kind of a failed request


@dataclass(frozen=True, slots=True)
class StageExcess:
    """One stage of one miss: its duration, its baseline, the excess, and whom it is charged to."""

    stage: str
    place: str
    cause: Cause
    duration_s: float
    baseline_s: float
    excess_s: float
    split: bool = True  # False: P's queue and prefill together (an unsampled record)


@dataclass(frozen=True, slots=True)
class Miss:
    """One request that missed: what it missed (``ttft``, ``tpot``, ``outcome``) and its excess by stage."""

    request_id: str
    proxy_in: float
    missed: tuple[str, ...]
    excess_s: float
    stages: tuple[StageExcess, ...]


@dataclass(frozen=True, slots=True)
class MissGroup:
    """The misses one (stage, place, cause) explains: their excess, share, count and since when."""

    stage: str
    place: str
    cause: Cause
    excess_s: float
    share: float
    count: int
    since: float
    last: float
    message: str


@dataclass(frozen=True)
class Attribution:
    """The attribution of one window."""

    since: float
    until: float
    requests: int
    healthy: int
    missed: int
    total_excess_s: float
    baseline_source: Literal["healthy", "zero"]
    baselines: dict[str, float]
    groups: tuple[MissGroup, ...]
    misses: tuple[Miss, ...] = field(default=())

    @property
    def top(self) -> tuple[MissGroup, ...]:
        """The top reasons we missed."""
        return self.groups[:TOP_N]

    def summary(self) -> str:
        """One line on the window (what the groups are out of)."""
        if self.requests == 0:
            return "no request records in the range"
        if self.missed == 0:
            return f"no request missed its SLO ({self.requests} requests)"
        base = (
            "" if self.baseline_source == "healthy" else "; no request met its SLO, so the baselines are zero"
        )
        return (
            f"{self.missed} of {self.requests} requests missed their SLO, "
            f"{self.total_excess_s:.3f} s of excess over the healthy requests' stages{base}"
        )

    def as_dict(self, max_misses: int = 100) -> dict[str, Any]:
        """JSON: the groups (``top`` the first three), and the ``max_misses`` misses with the most excess."""
        worst = sorted(self.misses, key=lambda m: (-m.excess_s, m.proxy_in, m.request_id))[:max_misses]
        return {
            "since": self.since,
            "until": self.until,
            "requests": self.requests,
            "healthy": self.healthy,
            "missed": self.missed,
            "total_excess_s": self.total_excess_s,
            "baseline_source": self.baseline_source,
            "baselines_s": dict(self.baselines),
            "summary": self.summary(),
            "top": [_group_json(g) for g in self.top],
            "groups": [_group_json(g) for g in self.groups],
            "misses": [_miss_json(m) for m in worst],
            "misses_shown": len(worst),
        }


def _group_json(g: MissGroup) -> dict[str, Any]:
    return {
        "stage": g.stage,
        "place": g.place,
        "cause": g.cause,
        "excess_s": g.excess_s,
        "share": g.share,
        "count": g.count,
        "since": g.since,
        "last": g.last,
        "message": g.message,
    }


def _miss_json(m: Miss) -> dict[str, Any]:
    return {
        "request_id": m.request_id,
        "proxy_in": m.proxy_in,
        "missed": list(m.missed),
        "excess_s": m.excess_s,
        "stages": [
            {
                "stage": s.stage,
                "place": s.place,
                "cause": s.cause,
                "duration_s": s.duration_s,
                "baseline_s": s.baseline_s,
                "excess_s": s.excess_s,
                "split": s.split,
            }
            for s in m.stages
        ],
    }


# -- stages of one record ------------------------------------------------------------------------

EPS_S: Final = 1e-3  # span ends and the record's timestamps come from different clocks' rounding


def _span(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else max(0.0, b - a)


def _pd_path(r: StageRecord) -> bool:
    return r.p_sent is not None or r.p_done is not None


def _handoff_end(r: StageRecord) -> float | None:
    return r.first_token if r.first_token is not None else (None if r.status == "ok" else r.done)


def front_attempts(r: StageRecord) -> tuple[Attempt, ...]:
    """The failed attempts before the record's own path began (before ``p_sent``, or ``d_sent``)."""
    start = r.p_sent if _pd_path(r) else r.d_sent
    if start is None:
        return ()
    return tuple(a for a in r.attempts if a.end <= start + EPS_S)


def handoff_attempts(r: StageRecord) -> tuple[Attempt, ...]:
    """The failed decode attempts within the record's own handoff (passed on to the next D)."""
    if r.p_done is None:
        return ()
    return tuple(a for a in r.attempts if a.stage == "decode" and a.start >= r.p_done - EPS_S)


def stage_durations(r: StageRecord) -> dict[str, float]:
    """The measured stages of ``r`` (seconds; ``p_total`` when P's split is unknown, ``tpot`` per token,
    ``transfer`` the D's mean KV transfer time; ``retry`` instead of ``admission`` when failed
    attempts came before the record's own path)."""
    out: dict[str, float] = {}
    pd_path = _pd_path(r)
    admitted = r.p_sent if pd_path else r.d_sent
    if (adm := _span(r.proxy_in, admitted)) is not None:
        out["retry" if front_attempts(r) else "admission"] = adm
    if (p_total := _span(r.p_sent, r.p_done)) is not None:
        out[P_TOTAL] = p_total
        if r.p_queue_s is not None and r.p_queue_s >= 0:
            q = min(r.p_queue_s, p_total)
            out["p_queue"] = q
            out["prefill"] = p_total - q
    end = _handoff_end(r)
    if pd_path:
        if (h := _span(r.p_done, end)) is not None:
            out["handoff"] = h
    elif (dq := _span(r.d_sent, end)) is not None:
        out["d_queue"] = dq
    if r.tpot_s is not None and r.tpot_s >= 0 and (r.completion_tokens or 0) > 1:
        out[TPOT] = r.tpot_s
    if r.transfer_s is not None and r.transfer_s >= 0:
        out[TRANSFER] = r.transfer_s
    return out


def _missed(r: StageRecord, slo: SLOSettings) -> tuple[str, ...]:
    """What ``r`` missed: () when it met every SLO."""
    v = slo_verdict(r.status, r.ttft_s, r.tpot_s, slo)
    if v.met:
        return ()
    if r.status != "ok":
        return ("outcome",)
    return tuple(k for k, ok in (("ttft", v.ttft_met), ("tpot", v.tpot_met)) if not ok)


def baselines_of(durations: Iterable[dict[str, float]]) -> dict[str, float]:
    """Each stage's median over the (healthy) records that measured it (``retry`` has none: see
    ``admission``)."""
    values: dict[str, list[float]] = defaultdict(list)
    for d in durations:
        for k, v in d.items():
            if k != "retry":
                values[k].append(v)
    return {k: median(v) for k, v in sorted(values.items())}


UNKNOWN: Final = "?"  # a pair's end no record named: "?->decode-1", a failed attempt whose P is not known


def _pair(p: str | None, d: str | None) -> str:
    return f"{p or UNKNOWN}->{d or UNKNOWN}"


def _place(stage: str, r: StageRecord) -> str:
    if stage == "admission":
        return PROXY
    if stage in ("p_queue", "prefill"):
        return r.p_instance or "unknown P"
    if stage == "handoff":
        return _pair(r.p_instance, r.d_instance)
    return r.d_instance or "unknown D"


def _cause(stage: str, r: StageRecord) -> Cause:
    if stage == "handoff":
        if r.lease_expired and (not r.lease_expired_ds or r.d_instance in r.lease_expired_ds):
            return "lease_expired"
        if r.transfer_failed:
            return "transfer_failed"
    if r.status != "ok" and stage == failed_stage(r):
        return f"failed:{r.error or r.status}"
    return "retried" if r.retries > 0 else "slow"


def attempt_place(a: Attempt) -> str:
    """A failed decode attempt's pair, a failed prefill attempt's P."""
    return _pair(a.p_instance, a.instance) if a.stage == "decode" else a.instance


def attempt_cause(a: Attempt, r: StageRecord) -> Cause:
    """Why an attempt failed: its lease ran out (forensics named its D), its D's KV reads failed, else
    the proxy's error kind."""
    if a.stage == "decode":
        if a.instance in r.lease_expired_ds:
            return "lease_expired"
        if a.transfer_failed:
            return "transfer_failed"
    return f"failed:{a.kind}"


def _on_attempts(
    r: StageRecord, attempts: Sequence[Attempt], duration: float, baseline: float
) -> list[StageExcess]:
    """``duration`` (over ``baseline``) spent on failed attempts: split over them by their own durations."""
    if duration <= baseline or not attempts:
        return []
    weights = [max(a.end - a.start, EPS_S) for a in attempts]
    total = sum(weights)
    return [
        StageExcess(
            "retry",
            attempt_place(a),
            attempt_cause(a, r),
            duration * w / total,
            baseline * w / total,
            (duration - baseline) * w / total,
        )
        for a, w in zip(attempts, weights, strict=True)
    ]


def failed_stage(r: StageRecord) -> str:
    """The stage a failed request ended in: prefill (no P answer), the handoff (no token: the record's
    first-token time may be where its handoff span ended), else decode."""
    if _pd_path(r) and r.p_done is None:
        return "prefill"
    if r.first_token is None or not r.completion_tokens:
        return "handoff" if _pd_path(r) else "d_queue"
    return "decode"


def _failure(r: StageRecord, shortfall: float) -> StageExcess:
    """What a failed request's measured stages leave of :func:`attribute`'s ``failure_s``: charged to
    the stage it ended in."""
    stage = failed_stage(r)
    return StageExcess(stage, _place(stage, r), _cause(stage, r), shortfall, 0.0, shortfall)


def _excess(
    r: StageRecord, d: dict[str, float], base: dict[str, float], missed: tuple[str, ...], failure_s: float
) -> list[StageExcess]:
    """The stages of one miss that went over their baseline, in what it missed."""
    ttft = "ttft" in missed or "outcome" in missed
    tpot = "tpot" in missed or "outcome" in missed
    out: list[StageExcess] = []

    def add(stage: str, dur: float, b: float, *, split: bool = True, scale: float = 1.0) -> None:
        if dur > b:
            out.append(
                StageExcess(
                    stage,
                    _place(stage, r),
                    _cause(stage, r),
                    dur * scale,
                    b * scale,
                    (dur - b) * scale,
                    split,
                )
            )

    if ttft:
        if "retry" in d:
            out.extend(_on_attempts(r, front_attempts(r), d["retry"], base.get("admission", 0.0)))
        for stage in TTFT_STAGES:
            if stage not in d:
                continue
            dur, b = d[stage], base.get(stage, 0.0)
            if stage == "handoff" and (passed := handoff_attempts(r)):
                part = min(max(0.0, dur - b), sum(a.end - a.start for a in passed))
                out.extend(_on_attempts(r, passed, part, 0.0))
                dur -= part
            add(stage, dur, b)
        if P_TOTAL in d and "p_queue" not in d:
            add("prefill", d[P_TOTAL], base.get(P_TOTAL, 0.0), split=False)
    if tpot and TPOT in d:
        add("decode", d[TPOT], base.get(TPOT, 0.0), scale=float((r.completion_tokens or 2) - 1))
    total = sum(s.excess_s for s in out)
    if "outcome" in missed and total < failure_s and any(k in d for k in (*TTFT_STAGES, "retry", P_TOTAL)):
        out.append(_failure(r, failure_s - total))
        total = failure_s
    return [s for s in out if s.excess_s >= NOISE_SHARE * total]


# -- link, NIC or D queue ------------------------------------------------------------------------


def _pair_ends(place: str) -> tuple[str, str] | None:
    p, sep, d = place.rpartition("->")
    return (p, d) if sep and p != EVERY_P and d != EVERY_D else None


def _kind(s: StageExcess) -> str:
    """What a pair-charged excess is, for its concentration: a slow handoff, else its cause."""
    return "slow" if _slow_handoff(s) else s.cause


Pair = tuple[str, str]  # (P, D)
# (instance, kind) -> the other ends of those of its pairs that hold their own misses
Spread = dict[tuple[str, str], frozenset[str]]


def spread_ds(
    misses: Sequence[Sequence[StageExcess]],
    met: Mapping[Pair, int],
    slow: Mapping[str, SlowHandoffs] | None = None,
) -> Spread:
    """The (D, kind) whose misses with pair-charged excess (handoffs, failed decode attempts) of that
    kind (a slow handoff, or its cause) are spread over the pairs of several P's, each with the Ps whose
    pairs hold their own misses (:func:`_holds`: links, their misses left on them); counted, not weighed:
    the excess of one miss varies with its place in a queue, the pair it was on does not. ``met``: the
    window's met requests per pair; ``slow``: each D's slow handoffs per P (:func:`slow_handoffs`)."""
    return _spread(misses, 1, met, slow)


def spread_ps(misses: Sequence[Sequence[StageExcess]], met: Mapping[Pair, int]) -> Spread:
    """The (P, kind) whose pair-charged misses of that kind are spread over the pairs of several D's
    alike: a P slow (or failing) toward every D, its row of the P×D matrix. A D's rule comes first
    (:func:`spread_ds`): where both apply (every pair slow), the D's queue or links are charged."""
    return _spread(misses, 0, met)


def _spread(
    misses: Sequence[Sequence[StageExcess]],
    side: int,
    met: Mapping[Pair, int],
    slow: Mapping[str, SlowHandoffs] | None = None,
) -> Spread:
    """(instance, kind) on ``side`` (0: P, 1: D) with the other ends of those of its pairs that hold their
    misses (:func:`_holds`), where some misses are left beside them (``met``: the met requests per pair;
    ``slow``: each D's slow handoffs per P, which judge a D's slow handoffs)."""
    by: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for stages in misses:
        pairs = {
            ((ends[side], _kind(s)), ends[1 - side])
            for s in stages
            if s.stage in ("handoff", "retry") and (ends := _pair_ends(s.place)) is not None
        }
        for key, other in pairs:
            by[key][other] += 1
    reached: dict[str, dict[str, int]] = defaultdict(dict)  # an instance -> its pairs' met requests
    for pd, n in met.items():
        reached[pd[side]][pd[1 - side]] = n
    out: Spread = {}
    for key, per in by.items():
        if key[0] == UNKNOWN:  # no instance to charge: the pair's other end judges it
            continue
        handoffs = (slow or {}).get(key[0]) if side == 1 and key[1] == "slow" else None
        held = _holds(per, reached.get(key[0], {}), handoffs)
        if held != per.keys():  # misses left beside the links: the instance's
            out[key] = frozenset(held)
    return out


# A pair holds its misses only when so many of them on it would be this unlikely were the misses drawn
# at random from the instance's requests (Fisher's exact test, one-sided), times the number of pairs (any
# of them could have been the one); and when its miss rate is this many times the other pairs'.
HELD_P = 0.01
LINK_RATE_RATIO = 3.0


def _holds(per: dict[str, int], met: dict[str, int], slow: SlowHandoffs | None = None) -> set[str]:
    """The pairs (by their other end) that hold their misses, of ``per``'s (misses counted per pair;
    ``met``: the met requests per pair). Misses on one pair only are that pair's (a few misses cannot
    tell a link from the instance, and where they fell is what is known), but a P-less pair's. Over
    several pairs, each that :func:`_over` finds over-represented among its requests (met, and missed of
    this kind). A pair whose P is not known holds nothing: it names no link.

    ``slow`` (a D's slow handoffs): judged by its slow handoffs, every request's, not by its misses. A
    P slower itself makes its requests miss more under a D's queue while their handoffs are the D's
    alike; counted as misses, that read as a link in 42-65 % of seeded windows. Where the misses fell
    on one pair, they are that pair's only where it handed off slow :data:`LINK_RATE_RATIO` times as often
    as the other pairs or more, and at all.

    Each pair against its own requests, so a proxy that sends more of a D's requests through one P (it
    picks each side on its own load) and so more of its misses when the D is slow does not make that pair
    a link; a pair whose every request missed, among others that met theirs, is one; and where every
    request missed nothing tells a link. Pair by pair, so a link beside the D's few stray misses elsewhere
    is still one."""
    if len(per) < 2:
        return {o for o in per if o != UNKNOWN and (slow is None or slow.as_slow_as_the_rest(o))}
    if slow is not None:
        return {o for o in _over(slow.slow, slow.timed) if o in per}
    return _over(per, {o: met.get(o, 0) + per.get(o, 0) for o in per.keys() | met.keys()})


def _over(events: Mapping[str, int], requests: Mapping[str, int]) -> set[str]:
    """The pairs (by their other end) over-represented in ``events`` among their ``requests`` (each pair's,
    events included): more of them than chance gives a pair of its requests were the events drawn at
    random from all of them (the hypergeometric tail, times the number of pairs, under :data:`HELD_P`), at
    a rate :data:`LINK_RATE_RATIO` times the other pairs' or more; never a pair whose P is not known."""
    n, total = sum(events.values()), sum(requests.values())
    held = set()
    for other, k in events.items():
        mine = requests.get(other, 0)
        rest_rate = (n - k) / (total - mine) if total > mine else 0.0
        if (
            k > 0
            and other != UNKNOWN
            and k >= LINK_RATE_RATIO * rest_rate * mine
            and _upper_tail(total, mine, n, k) * len(requests) < HELD_P
        ):
            held.add(other)
    return held


# A handoff this many times the median of its D's met requests', and past this percentile of them, is a
# slow one: the percentile keeps the D's usual handoffs under the line where they spread wide (a D's KV
# size follows its prompts'), so the other pairs' slow rate stays low by construction.
SLOW_HANDOFF = 1.5
SLOW_QUANTILE = 95.0


@dataclass(frozen=True)
class SlowHandoffs:
    """One D's handoffs per P (by name): how many were timed, and how many of those were slow (over
    :data:`SLOW_HANDOFF` times the median of the D's met requests' and their :data:`SLOW_QUANTILE`th
    percentile)."""

    timed: dict[str, int]
    slow: dict[str, int]

    def as_slow_as_the_rest(self, p: str) -> bool:
        """Whether ``p``'s pair was slow :data:`LINK_RATE_RATIO` times as often as the D's other pairs
        or more, and slow at all (true where it or the others timed nothing: nothing to tell by)."""
        mine, rest = self.timed.get(p, 0), sum(self.timed.values()) - self.timed.get(p, 0)
        if mine == 0 or rest == 0:
            return True
        own, rest_slow = self.slow.get(p, 0), sum(self.slow.values()) - self.slow.get(p, 0)
        return own > 0 and own / mine >= LINK_RATE_RATIO * rest_slow / rest


def slow_handoffs(
    records: Sequence[StageRecord], durations: Sequence[dict[str, float]], verdicts: Sequence[tuple[str, ...]]
) -> dict[str, SlowHandoffs]:
    """Per D with a met request's handoff timed: its served requests' handoffs per P, timed and slow (a
    failed request's span is no handoff: a timed-out one's is the timeout; the failed decode attempts a
    handoff passed on to the next D are cut out of it, as its excess is)."""
    by_d: dict[str, list[tuple[str, float, bool]]] = defaultdict(list)
    for r, d, v in zip(records, durations, verdicts, strict=True):
        if r.status == "ok" and r.p_instance and r.d_instance and "handoff" in d:
            own = d["handoff"] - math.fsum(a.end - a.start for a in handoff_attempts(r))
            by_d[r.d_instance].append((r.p_instance, own, bool(v)))
    out = {}
    for d_name, rows in by_d.items():
        met = sorted(h for _, h, missed in rows if not missed and math.isfinite(h))
        if not met:
            continue
        line = max(SLOW_HANDOFF * median(met), percentile_of_sorted(met, SLOW_QUANTILE))
        timed: dict[str, int] = defaultdict(int)
        slow: dict[str, int] = defaultdict(int)
        for p, h, _ in rows:
            timed[p] += 1
            slow[p] += h > line
        out[d_name] = SlowHandoffs(dict(timed), {p: n for p, n in slow.items() if n})
    return out


def _upper_tail(total: int, mine: int, drawn: int, k: int) -> float:
    """P(X >= k) for X the number of ``mine`` among ``drawn`` of ``total`` drawn at random (hypergeometric),
    in logarithms: the counts of a busy window overflow a float's binomial coefficients."""
    lo, hi = max(k, drawn - (total - mine)), min(drawn, mine)
    if lo > hi:
        return 0.0
    whole = _log_comb(total, drawn)
    terms = (_log_comb(mine, x) + _log_comb(total - mine, drawn - x) - whole for x in range(lo, hi + 1))
    return min(1.0, math.fsum(math.exp(t) for t in terms))


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def slow_pulls(
    raw: Sequence[tuple[StageRecord, Sequence[StageExcess]]],
    spread: Spread,
    base: dict[str, float],
) -> set[str]:
    """The spread D's whose KV pulls were slow: over their slow handoffs (but those of its pairs that hold
    their own: links), the D's median NIXL transfer time is at least :data:`SLOW_TRANSFER_RATIO` times
    the healthy requests' (``transfer``)."""
    healthy = base.get(TRANSFER, 0.0)
    if healthy <= 0:
        return set()
    seen: dict[str, list[float]] = defaultdict(list)
    for r, stages in raw:
        d = r.d_instance
        if (
            d is not None
            and r.p_instance not in spread.get((d, "slow"), {r.p_instance})
            and r.transfer_s is not None
            and any(_slow_handoff(s) for s in stages)
        ):
            seen[d].append(r.transfer_s)
    return {d for d, xs in seen.items() if median(xs) >= SLOW_TRANSFER_RATIO * healthy}


def _slow_handoff(s: StageExcess) -> bool:
    return s.stage == "handoff" and s.cause in ("slow", "retried")


def _relabel(
    stages: Sequence[StageExcess],
    spread: Spread,
    slow_pull: set[str],
    spread_p: Spread | None = None,
) -> tuple[StageExcess, ...]:
    """Charge a spread D's excess to the D, but on the pairs that hold their own: a slow handoff to every
    link into it when its KV pulls were slow, else to its queue; a failed attempt or a flagged or failed
    handoff to every link. What the D's rule leaves on a pair (its D not spread, or the pair holding its
    own there), a spread P's row takes (``spread_p``): to every link out of the P, but on the P's pairs
    that hold their own."""
    rows = spread_p or {}
    out: list[StageExcess] = []
    for s in stages:
        ends = _pair_ends(s.place) if s.stage in ("handoff", "retry") else None
        col = None if ends is None else spread.get((ends[1], _kind(s)))
        row = None if ends is None else rows.get((ends[0], _kind(s)))
        if ends is None:
            out.append(s)
        elif col is not None and ends[0] not in col:  # the D's, first
            if _slow_handoff(s) and ends[1] not in slow_pull:
                out.append(replace(s, stage="d_queue", place=ends[1]))
            else:
                out.append(replace(s, place=f"{EVERY_P}->{ends[1]}"))
        elif row is not None and ends[1] not in row:  # a pair the D's rule left alone, the P's
            out.append(replace(s, place=f"{ends[0]}->{EVERY_D}"))
        else:
            out.append(s)
    return tuple(out)


# -- grouping ------------------------------------------------------------------------------------


def _clock(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%H:%M:%S")


CAUSE_WORDS: Final[dict[str, str]] = {
    "lease_expired": "expired KV leases",
    "transfer_failed": "failed KV transfers",
    "retried": "after retries",
}


def _cause_words(cause: Cause) -> str:
    if cause in CAUSE_WORDS:
        return CAUSE_WORDS[cause]
    if cause.startswith("status:"):
        return f"status {cause.split(':', 1)[1]}"
    if cause.startswith("failed:"):
        return f"failed ({cause.split(':', 1)[1]})"
    return ""


def _place_words(place: str) -> str:
    if place.startswith(f"{EVERY_P}->"):
        return f"every link into {place[len(EVERY_P) + 2 :]}"
    if place.endswith(f"->{EVERY_D}"):
        return f"every link out of {place[: -len(EVERY_D) - 2]}"
    return place


def group_message(stage: str, place: str, cause: Cause, share: float, count: int, since: float) -> str:
    """What a group is, in words: "D queue on decode-2: 61% of the excess since 12:03:05 (14 misses)"."""
    label = STAGE_LABELS.get(stage, stage)
    what = _cause_words(cause)
    head = f"{label} on {_place_words(place)}" + (f", {what}" if what else "")
    noun = "miss" if count == 1 else "misses"
    return f"{head}: {share:.0%} of the excess since {_clock(since)} UTC ({count} {noun})"


def _group(misses: Sequence[Miss]) -> tuple[tuple[MissGroup, ...], float]:
    excess: dict[tuple[str, str, str], float] = defaultdict(float)
    count: dict[tuple[str, str, str], int] = defaultdict(int)
    first: dict[tuple[str, str, str], float] = {}
    last: dict[tuple[str, str, str], float] = {}
    for m in misses:
        keys = {(s.stage, s.place, s.cause) for s in m.stages}
        for s in m.stages:
            excess[(s.stage, s.place, s.cause)] += s.excess_s
        for k in keys:
            count[k] += 1
            first[k] = min(first.get(k, m.proxy_in), m.proxy_in)
            last[k] = max(last.get(k, m.proxy_in), m.proxy_in)
    total = sum(excess.values())
    counted = sum(count.values())
    groups = []
    for k in excess:
        share = excess[k] / total if total > 0 else count[k] / counted
        groups.append(
            MissGroup(
                k[0],
                k[1],
                k[2],
                excess[k],
                share,
                count[k],
                first[k],
                last[k],
                group_message(*k, share, count[k], first[k]),
            )
        )
    groups.sort(key=lambda g: (-g.share, -g.count, g.since, g.stage, g.place, g.cause))
    return tuple(groups), total


def _placeholder(r: StageRecord, missed: tuple[str, ...]) -> StageExcess:
    """A miss no measured stage explains: counted under ``outcome`` (failed) or ``unmeasured``."""
    if "outcome" in missed:
        return StageExcess(
            "outcome", r.d_instance or r.p_instance or PROXY, f"status:{r.status}", 0.0, 0.0, 0.0
        )
    return StageExcess("unmeasured", r.d_instance or r.p_instance or PROXY, "unknown", 0.0, 0.0, 0.0)


def attribute(
    records: Sequence[StageRecord],
    slo: SLOSettings,
    *,
    since: float,
    until: float,
    failure_s: float | None = None,
) -> Attribution:
    """The attribution of ``records`` (one window, ``since``..``until``) under ``slo``.

    ``failure_s``: the least excess a failed request counts (default: the TTFT target).
    """
    floor = slo.ttft.target_ms / 1000.0 if failure_s is None else failure_s
    durations = [stage_durations(r) for r in records]
    verdicts = [_missed(r, slo) for r in records]
    healthy = [d for d, v in zip(durations, verdicts, strict=True) if not v]
    source: Literal["healthy", "zero"] = "healthy" if healthy else "zero"
    base = baselines_of(healthy)
    raw = [
        (r, _excess(r, d, base, v, floor), v)
        for r, d, v in zip(records, durations, verdicts, strict=True)
        if v
    ]
    met = Counter(
        (r.p_instance, r.d_instance)
        for r, v in zip(records, verdicts, strict=True)
        if not v and r.p_instance and r.d_instance
    )
    spread = spread_ds([s for _, s, _ in raw], met, slow_handoffs(records, durations, verdicts))
    spread_p = spread_ps([s for _, s, _ in raw], met)
    slow_pull = slow_pulls([(r, s) for r, s, _ in raw], spread, base)
    misses = []
    for r, stages, v in raw:
        charged = _relabel(stages, spread, slow_pull, spread_p) or (_placeholder(r, v),)
        misses.append(Miss(r.request_id, r.proxy_in, v, sum(s.excess_s for s in charged), charged))
    groups, total = _group(misses)
    return Attribution(
        since=since,
        until=until,
        requests=len(records),
        healthy=len(healthy),
        missed=len(misses),
        total_excess_s=total,
        baseline_source=source,
        baselines=base,
        groups=groups,
        misses=tuple(misses),
    )
