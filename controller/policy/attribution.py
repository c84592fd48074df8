"""SLO-miss attribution: why the requests of a window missed their SLO, in stages, places and causes.

Every request record is cut into the stages it went through, from its stored timestamps and
in-vLLM durations::

    admission  proxy_in -> p_sent (d_sent on the decode-only path): waiting for admission at the proxy
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
window's healthy requests (those that met every SLO) where that stage was measured.

* **No healthy request** (every request missed): the baselines are zero, so a miss's excess is the
  whole of each stage; the result says so (``baseline_source``).
* **Noise.** Every stage varies about its median: in one miss, a stage whose excess is under
  :data:`NOISE_SHARE` (5%) of that miss's excess is not charged.
* **Unsampled records** (the proxy's root span only: no in-vLLM durations): P's queue and prefill
  are not split; the whole P time is compared with the healthy P time and charged to ``prefill``
  (``split: false`` on that stage). A stage whose timestamps are missing is not measured and
  charges nothing; a miss with no measured stage over its baseline is still counted, under
  ``outcome`` for a failed request, else ``unmeasured``.
* **A failed request without a first token** waited on its handoff until it ended (``done``).

Each stage's excess is charged to a place and a cause: admission to the proxy, P queue and prefill
to the P, handoff to the P×D pair, D queue and decode to the D; the cause is ``lease_expired``
(``lease_expiry_suspect``) or ``transfer_failed`` (a NIXL failure on the D during the handoff) for
a handoff, else ``retried`` for a request the proxy retried (its record keeps the last attempt's
P and D, and its stage times may hold the failed attempts' time), else ``slow``.

**Link or D queue:** the slow-handoff excess on one D is a bad link when one pair carries at least
``link_concentration`` of it (or the D was reached from one P only), and the D's own queue when it
is spread over the handoffs of several P's: then it is charged as ``d_queue`` on the D.

Misses are grouped by (stage, place, cause); a group's share is its part of the window's total
excess (of its count, when no miss has any excess), and its ``since`` the first miss in it. The
groups are sorted by share, then count; the first three are "the top reasons we missed", each
with a sentence saying what it is.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from statistics import median
from typing import Any, Final, Literal

from pdscope.config import SLOSettings
from pdscope.slo import slo_verdict

Stage = Literal["admission", "p_queue", "prefill", "handoff", "d_queue", "decode", "outcome", "unmeasured"]
Cause = str  # "slow" | "lease_expired" | "transfer_failed" | "retried" | "status:<status>" | "unknown"

STAGE_LABELS: Final[dict[str, str]] = {
    "admission": "admission wait",
    "p_queue": "P queue",
    "prefill": "prefill",
    "handoff": "handoff (incl. KV pull)",
    "d_queue": "D queue",
    "decode": "decode",
    "outcome": "failed requests",
    "unmeasured": "unmeasured stages",
}
TTFT_STAGES: Final = ("admission", "p_queue", "prefill", "handoff", "d_queue")
# internal baseline keys besides the stages: P's whole time (for unsampled records), TPOT per token
P_TOTAL: Final = "p_total"
TPOT: Final = "tpot"
TOP_N: Final = 3
PROXY: Final = "proxy"
# a stage whose excess is under this share of its miss's excess is noise (every stage varies about its median)
NOISE_SHARE: Final = 0.05


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


def _span(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else max(0.0, b - a)


def stage_durations(r: StageRecord) -> dict[str, float]:
    """The measured stages of ``r`` (seconds; ``p_total`` when P's split is unknown, ``tpot`` per token)."""
    out: dict[str, float] = {}
    pd_path = r.p_sent is not None or r.p_done is not None
    admitted = r.p_sent if pd_path else r.d_sent
    if (adm := _span(r.proxy_in, admitted)) is not None:
        out["admission"] = adm
    if (p_total := _span(r.p_sent, r.p_done)) is not None:
        out[P_TOTAL] = p_total
        if r.p_queue_s is not None and r.p_queue_s >= 0:
            q = min(r.p_queue_s, p_total)
            out["p_queue"] = q
            out["prefill"] = p_total - q
    end = r.first_token if r.first_token is not None else (None if r.status == "ok" else r.done)
    if pd_path:
        if (h := _span(r.p_done, end)) is not None:
            out["handoff"] = h
    elif (dq := _span(r.d_sent, end)) is not None:
        out["d_queue"] = dq
    if r.tpot_s is not None and r.tpot_s >= 0 and (r.completion_tokens or 0) > 1:
        out[TPOT] = r.tpot_s
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
    """Each stage's median over the (healthy) records that measured it."""
    values: dict[str, list[float]] = defaultdict(list)
    for d in durations:
        for k, v in d.items():
            values[k].append(v)
    return {k: median(v) for k, v in sorted(values.items())}


def _place(stage: str, r: StageRecord) -> str:
    if stage == "admission":
        return PROXY
    if stage in ("p_queue", "prefill"):
        return r.p_instance or "unknown P"
    if stage == "handoff":
        return f"{r.p_instance or '?'}->{r.d_instance or '?'}"
    return r.d_instance or "unknown D"


def _cause(stage: str, r: StageRecord) -> Cause:
    if stage == "handoff":
        if r.lease_expired:
            return "lease_expired"
        if r.transfer_failed:
            return "transfer_failed"
    return "retried" if r.retries > 0 else "slow"


def _excess(
    r: StageRecord, d: dict[str, float], base: dict[str, float], missed: tuple[str, ...]
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
        for stage in TTFT_STAGES:
            if stage in d:
                add(stage, d[stage], base.get(stage, 0.0))
        if P_TOTAL in d and "p_queue" not in d:
            add("prefill", d[P_TOTAL], base.get(P_TOTAL, 0.0), split=False)
    if tpot and TPOT in d:
        add("decode", d[TPOT], base.get(TPOT, 0.0), scale=float((r.completion_tokens or 2) - 1))
    total = sum(s.excess_s for s in out)
    return [s for s in out if s.excess_s >= NOISE_SHARE * total]


# -- link or D queue -----------------------------------------------------------------------------


def _queued_ds(
    misses: Sequence[tuple[StageRecord, list[StageExcess]]], link_concentration: float
) -> set[str]:
    """The D's whose slow-handoff excess is spread over the handoffs of several P's (its queue)."""
    by_d: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r, stages in misses:
        for s in stages:
            if s.stage == "handoff" and s.cause == "slow" and r.d_instance:
                by_d[r.d_instance][r.p_instance or "?"] += s.excess_s
    out: set[str] = set()
    for d, per_p in by_d.items():
        total = sum(per_p.values())
        if len(per_p) >= 2 and total > 0 and max(per_p.values()) / total < link_concentration:
            out.add(d)
    return out


def _relabel(r: StageRecord, stages: list[StageExcess], queued: set[str]) -> tuple[StageExcess, ...]:
    if r.d_instance not in queued:
        return tuple(stages)
    return tuple(
        replace(s, stage="d_queue", place=r.d_instance) if s.stage == "handoff" and s.cause == "slow" else s
        for s in stages
    )


# -- grouping ------------------------------------------------------------------------------------


def _clock(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%H:%M:%S")


CAUSE_WORDS: Final[dict[str, str]] = {
    "lease_expired": "expired KV leases",
    "transfer_failed": "failed KV transfers",
    "retried": "after retries",
}


def group_message(stage: str, place: str, cause: Cause, share: float, count: int, since: float) -> str:
    """What a group is, in words: "D queue on decode-2: 61% of the excess since 12:03:05 (14 misses)"."""
    label = STAGE_LABELS.get(stage, stage)
    what = CAUSE_WORDS.get(cause) or (
        f"status {cause.split(':', 1)[1]}" if cause.startswith("status:") else ""
    )
    head = f"{label} on {place}" + (f", {what}" if what else "")
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
    link_concentration: float = 0.7,
) -> Attribution:
    """The attribution of ``records`` (one window, ``since``..``until``) under ``slo``."""
    durations = [stage_durations(r) for r in records]
    verdicts = [_missed(r, slo) for r in records]
    healthy = [d for d, v in zip(durations, verdicts, strict=True) if not v]
    source: Literal["healthy", "zero"] = "healthy" if healthy else "zero"
    base = baselines_of(healthy)
    raw = [(r, _excess(r, d, base, v), v) for r, d, v in zip(records, durations, verdicts, strict=True) if v]
    queued = _queued_ds([(r, s) for r, s, _ in raw], link_concentration)
    misses = []
    for r, stages, v in raw:
        charged = _relabel(r, stages, queued) or (_placeholder(r, v),)
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
