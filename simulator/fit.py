"""Fit the simulator to a fleet that ran: plain values in, a fitted fleet description out (pure).

``pdscope whatif`` reads a stored window (request records, snapshots) and hands this module plain
values: one :class:`RequestObs` per request record and one :class:`SnapshotObs` per D snapshot.
:func:`fit` returns a :class:`FittedFleet`:

* the workload: every arrival's offset and lengths (the trace replayed), the arrival rate per
  bucket and the inter-arrival CV (burstiness: 1 for Poisson), the length distributions'
  quantiles;
* per instance, the engine knobs of ``simulator.instances``: a P's ``prefill_tokens_per_s``
  (prompt tokens over its prefill time less one step's overhead, in its normal buckets; the tokens it
  computed, its prefix-cache hits left out, and a request mostly cached not read at all) and a D's
  ``step_overhead_s`` (its normal TPOT: one decode step);
* the fleet's ``link_bandwidth_bytes_per_s``: the higher of the D snapshots' NIXL bytes over
  NIXL transfer time (the fastest D) and the median KV bytes over the typical handoff less 1.5
  steps (both are lower bounds: waits only add time);
* time-varying degradations as the simulator's own fault specs (simulator/faults.py), at their
  offsets from the window's start: ``slow`` on a P whose prefill time per token (or a D whose
  TPOT) is ``degraded_ratio`` times its own normal for a while, ``slow_link`` on a P x D pair
  whose handoff (P done to D's first token) is that much over the fleet's typical handoff.

A bucket's level is the low decile (``low_quantile``) of its samples: queueing only adds time.
An instance's normal is its best bucket level (``normal_quantile`` 0), so an instance degraded
for part of the window, even most of it, is judged against its own healthy buckets, and one slow
for the whole window is fitted as a slower engine (the same thing to the simulator).

A degradation is a spell of ``min_samples`` or more consecutive samples at ``degraded_ratio`` x
normal or over, lasting ``min_spell_s`` or more: samples, not buckets, since an instance the
controller drained gets only a trickle. Its factor is the spell's low decile over the normal; a
spell whose low decile is not itself degraded (some requests batched or queued, the engine fine)
or a shorter one is no fault: the replay's own load reproduces those.

Known limits: prefill batching is not separated from prefill rate (at high load the fitted rate
is low), decode slowing with batch size is folded into the step overhead, and a degradation
shorter than ``min_spell_s`` is not fitted. What could not be fitted is said in
``FittedFleet.notes``.

No I/O, no clock: the window comes in as arguments.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdscope.stats import percentile
from simulator.faults import FaultSpec

# The simulator's defaults the fit falls back on (pdscope.simconfig.SimulatorConfig's).
DEFAULT_STEP_OVERHEAD_S = 0.010
DEFAULT_LINK_BYTES_PER_S = 25e9


@dataclass(frozen=True)
class RequestObs:
    """One request record, as plain values (``pdscope.cli.whatif`` reads them from the store)."""

    arrival: float  # proxy_in, Unix seconds
    status: str
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    p: str | None = None
    d: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    p_prefill_s: float | None = None
    handoff_s: float | None = None  # first_token - p_done
    kv_bytes: int | None = None
    p_cached_tokens: int | None = None  # the prompt tokens P took from its prefix cache (None: unknown)


@dataclass(frozen=True)
class SnapshotObs:
    """One scrape of one D: its NIXL counters as scraped (cumulative)."""

    instance: str
    ts: float
    xfer_time_sum: float | None
    bytes_sum: float | None


@dataclass(frozen=True)
class FitParams:
    bucket_s: float = 5.0
    degraded_ratio: float = 1.5  # a bucket this many times the normal is degraded
    min_samples: int = 3  # per bucket for its level to count; in a row for a degradation
    # of an instance's bucket medians: its normal (0: its best bucket, so that a degradation over most
    # of the window is still found against the few healthy buckets before it)
    normal_quantile: float = 0.0
    # of a bucket's or a degraded spell's samples: the engine's (or link's) own time, short of the waits
    low_quantile: float = 0.1
    # a degradation shorter than this is no fault: a burst of batched prefills or queued handoffs,
    # which the replay's own load reproduces
    min_spell_s: float = 5.0


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds from the window's start
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class InstanceFit:
    name: str
    role: str  # prefill | decode
    samples: int
    prefill_tokens_per_s: float | None = None  # P
    step_overhead_s: float | None = None  # D: its normal TPOT

    def overrides(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.prefill_tokens_per_s is not None:
            out["prefill_tokens_per_s"] = round(self.prefill_tokens_per_s, 1)
        if self.step_overhead_s is not None:
            out["step_overhead_s"] = round(self.step_overhead_s, 6)
        return out


@dataclass(frozen=True)
class FittedFleet:
    since: float
    until: float
    bucket_s: float
    arrivals: tuple[Arrival, ...]
    rate_per_bucket: tuple[float, ...]
    interarrival_cv: float | None
    prompt_quantiles: dict[str, float]
    output_quantiles: dict[str, float]
    instances: dict[str, InstanceFit]
    step_overhead_s: float
    link_bandwidth_bytes_per_s: float
    typical_handoff_s: float | None
    faults: tuple[FaultSpec, ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def duration_s(self) -> float:
        return self.until - self.since

    def roles(self) -> dict[str, str]:
        return {n: i.role for n, i in sorted(self.instances.items())}

    def prefills(self) -> list[str]:
        return sorted(n for n, i in self.instances.items() if i.role == "prefill")

    def decodes(self) -> list[str]:
        return sorted(n for n, i in self.instances.items() if i.role == "decode")

    def simulator_section(self) -> dict[str, Any]:
        """The fitted knobs of a ``simulator:`` section (the caller adds ports, seed, tracing)."""
        return {
            "step_overhead_s": round(self.step_overhead_s, 6),
            "decode_per_seq_s": 0.0,  # folded into each D's step overhead (its TPOT)
            "link_bandwidth_bytes_per_s": self.link_bandwidth_bytes_per_s,
            "instances": {n: i.overrides() for n, i in sorted(self.instances.items()) if i.overrides()},
        }

    def compression(self, max_replay_s: float) -> int:
        """How many times the replay is thinned and shortened to last at most ``max_replay_s``."""
        if max_replay_s <= 0:
            raise ValueError("max_replay_s must be positive")
        return max(1, math.ceil(self.duration_s / max_replay_s - 1e-9))

    def replay_trace(self, k: int) -> list[Arrival]:
        """Every ``k``-th arrival at ``at / k``: the same rate over ``1/k`` of the time."""
        return [Arrival(a.at / k, a.prompt_tokens, a.output_tokens) for a in self.arrivals[::k]]

    def scenario(self, k: int) -> list[FaultSpec]:
        """The fitted faults on the replay's clock (offsets and durations divided by ``k``)."""
        return [
            f.model_copy(update={"at": f.at / k, "duration": None if f.duration is None else f.duration / k})
            for f in self.faults
        ]

    def summary(self) -> dict[str, Any]:
        return {
            "since": self.since,
            "until": self.until,
            "requests": len(self.arrivals),
            "rate_per_s": len(self.arrivals) / self.duration_s if self.duration_s > 0 else None,
            "rate_per_bucket": list(self.rate_per_bucket),
            "bucket_s": self.bucket_s,
            "interarrival_cv": self.interarrival_cv,
            "prompt_tokens": self.prompt_quantiles,
            "output_tokens": self.output_quantiles,
            "simulator": self.simulator_section(),
            "typical_handoff_s": self.typical_handoff_s,
            "faults": [f.model_dump(exclude_none=True) for f in self.faults],
            "notes": list(self.notes),
        }


class FitError(ValueError):
    """Nothing to fit (no request in the window, no instance seen), or a parameter out of its bounds
    (the message names it)."""


MAX_BUCKETS = 100_000  # time buckets over the window at most: each series holds one value per bucket
# each parameter's bounds (inclusive); NaN and infinities are refused
PARAM_BOUNDS: dict[str, tuple[float, float]] = {
    "bucket_s": (0.1, 3600.0),
    "degraded_ratio": (1.0, 100.0),
    "min_samples": (1, 100_000),
    "normal_quantile": (0.0, 1.0),
    "low_quantile": (0.0, 1.0),
    "min_spell_s": (0.0, 86_400.0),
}


def check_params(p: FitParams, since: float, until: float) -> None:
    """Raise :class:`FitError` naming the first parameter out of :data:`PARAM_BOUNDS`, the window when it
    is not finite, or ``bucket_s`` when the window holds more than :data:`MAX_BUCKETS` buckets."""
    if not (math.isfinite(since) and math.isfinite(until)):
        raise FitError("the window's ends must be finite")
    for name, (lo, hi) in PARAM_BOUNDS.items():
        value = getattr(p, name)
        if not math.isfinite(value) or not lo <= value <= hi:
            raise FitError(f"{name}: must be a finite number from {lo:g} to {hi:g} (got {value!r})")
    if (until - since) / p.bucket_s > MAX_BUCKETS:
        raise FitError(f"bucket_s: {until - since:g} s / {p.bucket_s:g} s is over {MAX_BUCKETS} buckets")


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _quantile(xs: Sequence[float], q: float) -> float | None:
    """The kernel's percentile of ``xs`` at ``q`` in 0..1 (None for no values)."""
    return percentile(xs, 100.0 * q)


def _quantiles(xs: Sequence[float]) -> dict[str, float]:
    if not xs:
        return {}
    return {f"p{int(q * 100)}": float(_quantile(xs, q) or 0.0) for q in (0.1, 0.5, 0.9, 0.99)}


def _cv(times: Sequence[float]) -> float | None:
    gaps = [b - a for a, b in itertools.pairwise(times)]
    if len(gaps) < 2:
        return None
    mean = statistics.fmean(gaps)
    return statistics.pstdev(gaps) / mean if mean > 0 else None


class _Series:
    """Per-key samples of one figure, with their times."""

    def __init__(self, since: float, until: float, params: FitParams) -> None:
        self.since = since
        self.until = until
        self.p = params
        self.by: dict[Any, list[tuple[float, float]]] = defaultdict(list)

    def add(self, key: Any, ts: float, value: float) -> None:
        self.by[key].append((ts, value))

    def levels(self, key: Any) -> dict[int, float]:
        """Each bucket's level: the ``low_quantile`` of its samples (a bucket with fewer than
        ``min_samples`` counts for nothing). A low quantile, not the median: queueing only adds time."""
        buckets: dict[int, list[float]] = defaultdict(list)
        for ts, v in self.by[key]:
            buckets[int((ts - self.since) // self.p.bucket_s)].append(v)
        return {
            b: float(_quantile(v, self.p.low_quantile) or 0.0)
            for b, v in sorted(buckets.items())
            if len(v) >= self.p.min_samples
        }

    def normal(self, key: Any) -> float | None:
        """The key's normal: the ``normal_quantile`` of its bucket levels."""
        return _quantile(list(self.levels(key).values()), self.p.normal_quantile)

    def all_values(self, key: Any) -> list[float]:
        return [v for _, v in self.by[key]]

    def spells(self, key: Any, base: float) -> list[tuple[float, float, float]]:
        """Spells of ``min_samples`` or more consecutive samples at ``degraded_ratio`` x ``base`` or
        over: (start, end) as offsets from the window's start, each halfway to the neighbouring
        healthy sample (the window's edge where there is none), and the spell's ``low_quantile``
        over ``base``. Samples, not buckets: a degraded instance the controller drained gets a
        trickle, too few a bucket."""
        rows = sorted(self.by[key])
        out: list[tuple[float, float, float]] = []
        i = 0
        while i < len(rows):
            if rows[i][1] < self.p.degraded_ratio * base:
                i += 1
                continue
            j = i
            while j + 1 < len(rows) and rows[j + 1][1] >= self.p.degraded_ratio * base:
                j += 1
            lo = self.since if i == 0 else (rows[i - 1][0] + rows[i][0]) / 2
            hi = self.until if j == len(rows) - 1 else (rows[j][0] + rows[j + 1][0]) / 2
            if j - i + 1 >= self.p.min_samples and hi - lo >= self.p.min_spell_s:
                low = float(_quantile([v for _, v in rows[i : j + 1]], self.p.low_quantile) or 0.0)
                out.append((lo - self.since, hi - self.since, low / base))
            i = j + 1
        return out


def _bandwidth(snaps: Iterable[SnapshotObs]) -> float | None:
    """Bytes over transfer time between each D's first and last scrape; the fastest D."""
    by: dict[str, list[SnapshotObs]] = defaultdict(list)
    for s in snaps:
        if s.xfer_time_sum is not None and s.bytes_sum is not None:
            by[s.instance].append(s)
    best: float | None = None
    for rows in by.values():
        rows.sort(key=lambda s: s.ts)
        d_time = (rows[-1].xfer_time_sum or 0.0) - (rows[0].xfer_time_sum or 0.0)
        d_bytes = (rows[-1].bytes_sum or 0.0) - (rows[0].bytes_sum or 0.0)
        if d_time > 0 and d_bytes > 0:
            bw = d_bytes / d_time
            best = bw if best is None else max(best, bw)
    return best


def _check(
    requests: Sequence[RequestObs], roles: dict[str, str], since: float, until: float
) -> list[RequestObs]:
    if until <= since:
        raise FitError("the window is empty (until <= since)")
    reqs = sorted((r for r in requests if since <= r.arrival <= until), key=lambda r: r.arrival)
    if not reqs:
        raise FitError("no request record in the window")
    if not any(v == "prefill" for v in roles.values()) or not any(v == "decode" for v in roles.values()):
        raise FitError("the window names no prefill or no decode instance")
    return reqs


@dataclass(frozen=True)
class _Workload:
    arrivals: tuple[Arrival, ...]
    rates: tuple[float, ...]
    prompts: list[float]
    outputs: list[float]
    med_prompt: int


def _workload(reqs: Sequence[RequestObs], since: float, until: float, p: FitParams) -> _Workload:
    prompts = [float(r.prompt_tokens) for r in reqs if r.prompt_tokens]
    outputs = [float(r.output_tokens) for r in reqs if r.output_tokens]
    med_prompt = int(_median(prompts) or 1)
    med_output = int(_median(outputs) or 1)
    arrivals = tuple(
        Arrival(r.arrival - since, r.prompt_tokens or med_prompt, r.output_tokens or med_output) for r in reqs
    )
    n_buckets = max(1, math.ceil((until - since) / p.bucket_s))
    counts = [0] * n_buckets
    for a in arrivals:
        counts[min(n_buckets - 1, int(a.at // p.bucket_s))] += 1
    return _Workload(arrivals, tuple(c / p.bucket_s for c in counts), prompts, outputs, med_prompt)


def _slow_faults(series: _Series, name: str, base: float | None, p: FitParams) -> list[FaultSpec]:
    out: list[FaultSpec] = []
    if base is None or base <= 0:
        return out
    for at, end, factor in series.spells(name, base):
        if factor >= p.degraded_ratio:  # else only some samples were slow: batching or queueing
            out.append(
                FaultSpec(kind="slow", instance=name, factor=round(factor, 3), at=round(at, 3),
                          duration=round(end - at, 3))
            )  # fmt: skip
    return out


def _computed(r: RequestObs) -> int | None:
    """The prompt tokens P computed (those it took from its prefix cache left out); None when unknown,
    or when the cache held half the prompt or more: one step's overhead is then most of its prefill
    time. A prefix-cache hit read per prompt token is a P many times faster than it is: inside a slow
    P's spell it ended the spell (a CI run of stop 46: 2,032 of 2,048 tokens cached, the spell fitted
    from 16 s for a fault from 10 s)."""
    if not r.prompt_tokens:
        return None
    cached = max(0, min(r.p_cached_tokens or 0, r.prompt_tokens))
    return None if 2 * cached >= r.prompt_tokens else r.prompt_tokens - cached


def _engines(
    ok: Sequence[RequestObs], roles: dict[str, str], w: _Workload, series: tuple[_Series, _Series],
    notes: list[str],
) -> tuple[dict[str, InstanceFit], float, list[FaultSpec]]:  # fmt: skip
    """Each instance's engine knobs, the fleet's step overhead, the slow spells as faults."""
    tpot, per_tok = series
    p = tpot.p
    for r in ok:
        if r.d and r.tpot_s is not None and r.tpot_s > 0:  # D: TPOT is one decode step
            tpot.add(r.d, r.arrival, r.tpot_s)
        if r.p and r.p_prefill_s and (computed := _computed(r)):  # P: prefill time per token it computed
            per_tok.add(r.p, r.arrival, r.p_prefill_s / computed)
    d_normal = {d: tpot.normal(d) for d in roles if roles[d] == "decode"}
    known = [v for v in d_normal.values() if v is not None]
    step_overhead = _median(known) or DEFAULT_STEP_OVERHEAD_S
    if not known:
        notes.append(f"no TPOT in the window: step overhead is the simulator's default {step_overhead}s")
    instances: dict[str, InstanceFit] = {}
    faults: list[FaultSpec] = []
    for name, role in sorted(roles.items()):
        if role != "prefill":
            normal = d_normal.get(name)
            instances[name] = InstanceFit(name, role, len(tpot.all_values(name)), step_overhead_s=normal)
            faults += _slow_faults(tpot, name, normal, p)
            continue
        normal = per_tok.normal(name)
        rate = None
        if normal is not None:  # one step: overhead + tokens / rate, at the median prompt
            net = normal * w.med_prompt - step_overhead
            rate = w.med_prompt / net if net > 0 else 1.0 / normal
        else:
            notes.append(f"{name}: no prefill time measured: the simulator's default rate")
        instances[name] = InstanceFit(name, role, len(per_tok.all_values(name)), prefill_tokens_per_s=rate)
        faults += _slow_faults(per_tok, name, normal, p)
    return instances, step_overhead, faults


def _links(
    ok: Sequence[RequestObs], hand: _Series, snapshots: Sequence[SnapshotObs], step_overhead: float,
    notes: list[str],
) -> tuple[float, float | None, list[FaultSpec]]:  # fmt: skip
    """The link bandwidth, the typical handoff, the slow-link spells as faults."""
    p = hand.p
    kv_bytes = [float(r.kv_bytes) for r in ok if r.kv_bytes]
    for r in ok:
        if r.p and r.d and r.handoff_s is not None and r.handoff_s >= 0:
            hand.add((r.p, r.d), r.arrival, r.handoff_s)
    normals = [v for v in (hand.normal(k) for k in list(hand.by)) if v is not None]
    typical = _median(normals)
    # Both are lower bounds of the link's bandwidth (a transfer's time includes its wait for the
    # link, a handoff's its wait for D's step): the higher one is the nearer.
    med_bytes = _median(kv_bytes)
    from_snaps = _bandwidth(snapshots)
    from_handoff = None
    if typical is not None and med_bytes:
        from_handoff = med_bytes / max(typical - 1.5 * step_overhead, typical * 0.1)
    known_bw = [b for b in (from_snaps, from_handoff) if b is not None]
    bw = max(known_bw) if known_bw else DEFAULT_LINK_BYTES_PER_S
    if not known_bw:
        notes.append("no KV transfer measured: the simulator's default link bandwidth")
    elif from_snaps is None:
        notes.append("no NIXL figures in the snapshots: link bandwidth from the handoff time")
    faults: list[FaultSpec] = []
    if typical is None or typical <= 0:
        return bw, typical, faults
    wire_base = (med_bytes / bw) if med_bytes else typical / 2
    other = max(typical - wire_base, 0.0)
    for key in sorted(hand.by):
        for at, end, ratio in hand.spells(key, typical):
            factor = (ratio * typical - other) / wire_base
            if factor >= p.degraded_ratio:  # else queueing behind busy peers, not a slow link
                faults.append(
                    FaultSpec(kind="slow_link", prefill=key[0], decode=key[1], factor=round(factor, 3),
                              at=round(at, 3), duration=round(end - at, 3))
                )  # fmt: skip
    return bw, typical, faults


def fit(
    requests: Sequence[RequestObs],
    roles: dict[str, str],
    since: float,
    until: float,
    *,
    snapshots: Sequence[SnapshotObs] = (),
    params: FitParams | None = None,
) -> FittedFleet:
    """The fitted fleet of the window ``[since, until]``. ``roles``: instance name -> prefill|decode
    (every instance that ran, also those no request reached)."""
    p = params or FitParams()
    check_params(p, since, until)
    reqs = _check(requests, roles, since, until)
    notes: list[str] = []
    w = _workload(reqs, since, until, p)
    ok = [r for r in reqs if r.status == "ok"]
    series = (_Series(since, until, p), _Series(since, until, p))
    instances, step_overhead, faults = _engines(ok, roles, w, series, notes)
    bw, typical, link_faults = _links(ok, _Series(since, until, p), snapshots, step_overhead, notes)
    faults = sorted([*faults, *link_faults], key=lambda f: (f.at, f.kind, sorted(f.instances())))
    return FittedFleet(
        since=since,
        until=until,
        bucket_s=p.bucket_s,
        arrivals=w.arrivals,
        rate_per_bucket=w.rates,
        interarrival_cv=_cv([a.at for a in w.arrivals]),
        prompt_quantiles=_quantiles(w.prompts),
        output_quantiles=_quantiles(w.outputs),
        instances=instances,
        step_overhead_s=step_overhead,
        link_bandwidth_bytes_per_s=float(bw),
        typical_handoff_s=typical,
        faults=tuple(faults),
        notes=tuple(notes),
    )
