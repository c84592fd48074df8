"""Per-signal health scores for one instance, each in [0, 1] (1 = healthy).

Latency-like signals are scored *relative to the instance's peers* (same role, up,
observed): slower than ``latency_tolerance`` times the median of the others costs
weight in proportion, so a uniformly slow fleet keeps equal weights (admission limits
deal with absolute load) and one instance that is 10x slower loses ~90%. Error rates
and KV usage are scored on absolute scales.

Which signals count, per role:

* prefill: ``ttft`` (its queue + prefill time), ``ttft_now``, ``handoff`` (how fast D
  pulls its KV), ``load``, ``errors`` (failed NIXL transfers it records), ``kv``
  (includes leased blocks).
* decode: ``handoff`` (P done -> first token, which includes D's queue and the NIXL
  pull), ``nixl`` (transfer time per transfer), ``nixl_now``, ``load``, ``errors`` (failed
  transfers plus the lease expiries the collector attributed to handoffs sent to it that were
  still waiting when the lease ran out: P counts expiries, but a D that does not pull in time
  causes them), ``kv``.
* both: ``failures``, the instance's own failed requests (the lower confidence bound of their
  share, from ``min_error_events`` failures on).

Significance: every relative tolerance is widened by ``noise_z`` combined relative standard
errors (the value's and its peers' median's), and error counts score only from
``min_error_events`` in the window, so small samples and one or two peers do not cut.

``ttft``, ``handoff`` and ``nixl`` are measured over the window's finished requests and
transfers, so they lag a fault by the time a slow request takes to finish, and then by
the window's older samples. The fast ones use the last three scrapes only (noisier, so
``load_tolerance`` x the peers' median): ``ttft_now`` / ``nixl_now`` are vLLM's own TTFT
and NIXL-transfer histograms, and ``load`` is Little's law on the gauges: the requests the
instance holds at the latest scrape (P: running + waiting; D: in a KV-fetch stage) ÷ the
ones it finished per second over the last three scrapes, i.e. how long a request spends
there now. A stuck instance finishes nothing and shows at once; and since the proxy
balances in-flight load across instances, a slow one holds no more requests than its
peers, only for longer, which only a time shows.

A ``handoff`` whose typical value alone is over the TTFT target, while the peers' is
well within it, scores 0: every request sent there misses the SLO, so proportional
sharing would only spread failures. The weight goes to the floor (a trickle that shows
when the instance is well again).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from statistics import median

from analysis.blame import Factorization
from controller.policy.config import PolicyConfig
from controller.policy.signals import InstanceSignals
from pdscope.reasons import Reason

SIGNAL_REASONS: dict[str, Reason] = {
    "ttft": Reason.SLOW_PREFILL,
    "handoff": Reason.SLOW_HANDOFF,
    "nixl": Reason.SLOW_KV_TRANSFER,
    "ttft_now": Reason.SLOW_PREFILL,
    "speed": Reason.SLOW_PREFILL,
    "nixl_now": Reason.SLOW_KV_TRANSFER,
    "load": Reason.BACKLOG,
    "errors": Reason.TRANSFER_FAILURES,
    "failures": Reason.REQUEST_FAILURES,
    "kv": Reason.KV_CACHE_PRESSURE,
}


@dataclass(frozen=True)
class Score:
    """One signal's score with what it was computed from, for the decision record."""

    name: str
    value: float
    observed: float | None
    reference: float | None
    note: str


def _score_against(
    value: float | None, peers_median: float | None, tolerance: float, floor: float, margin: float
) -> tuple[float, float | None]:
    if value is None or peers_median is None:
        return 1.0, None
    ref = max(peers_median, floor)
    limit = ref * tolerance * max(1.0, margin)
    if value <= limit:
        return 1.0, ref
    return min(1.0, limit / value), ref


def noise_margin(own_rse: float | None, peer_rses: Sequence[float], z: float) -> float:
    """1 + z x the combined relative standard error of a value and of its peers' median.

    The median of k peers is taken as noisy as one of them over sqrt(k): with one or two peers the
    reference is itself a small sample, and the margin says so."""
    return _margin(own_rse, median(peer_rses) if peer_rses else None, len(peer_rses), z)


def _margin(own_rse: float | None, peers_rse_median: float | None, k: int, z: float) -> float:
    own = own_rse or 0.0
    ref = peers_rse_median / math.sqrt(k) if peers_rse_median is not None and k else 0.0
    return 1.0 + z * math.sqrt(own * own + ref * ref)


def count_rse(n: float | None) -> float | None:
    """The relative standard error of a mean over ``n`` samples whose spread is unknown (taken as cv 1)."""
    return None if n is None or n <= 0 else 1.0 / math.sqrt(n)


def error_score(rate_per_min: float, ref_per_min: float) -> float:
    """1 with no errors, 0.5 at ``ref_per_min``, towards 0 as errors grow."""
    return 1.0 / (1.0 + max(0.0, rate_per_min) / ref_per_min)


def failure_fraction_low(failed: int, requests: int, z: float) -> float:
    """The lower confidence bound (z standard errors) of the share of requests that failed."""
    n = max(requests, failed)
    if n <= 0 or failed <= 0:
        return 0.0
    f = failed / n
    return max(0.0, f - z * math.sqrt(f * (1.0 - f) / n))


def kv_score(usage: float | None, cfg: PolicyConfig) -> float:
    """1 up to ``kv_soft``, falling linearly to ``kv_floor_score`` at 100% usage."""
    if usage is None or usage <= cfg.kv_soft:
        return 1.0
    frac = min(1.0, (usage - cfg.kv_soft) / (1.0 - cfg.kv_soft))
    return 1.0 - frac * (1.0 - cfg.kv_floor_score)


def _latency(inst: InstanceSignals, cfg: PolicyConfig) -> tuple[float | None, float | None]:
    if inst.contribution_s is not None and inst.requests >= cfg.min_samples:
        return inst.contribution_s, inst.contribution_rse or count_rse(inst.requests)
    return None, None


def _handoff(inst: InstanceSignals, cfg: PolicyConfig) -> tuple[float | None, float | None]:
    if inst.handoff_p50_s is not None and inst.requests >= cfg.min_samples:
        # the standard error of a median is about 1.25 that of a mean
        return inst.handoff_p50_s, 1.25 * (inst.handoff_rse or count_rse(inst.requests) or 0.0)
    if inst.role == "decode" and inst.queue_mean_s is not None and inst.nixl_transfers >= cfg.min_samples:
        # D's queue time includes the KV pull (vLLM queues a request until its KV has arrived): a fallback
        # without records.
        return inst.queue_mean_s, count_rse(inst.nixl_transfers)
    return None, None


def _load(inst: InstanceSignals, cfg: PolicyConfig) -> tuple[float | None, float | None]:
    """Little's law on counts: held / (done / s); the completions over three scrapes are a Poisson count
    (rse 1/sqrt(done)), the held ones a fact at the scrape."""
    if inst.hold_time_now_s is None:
        return None, None
    done = max(inst.load_done if inst.load_done is not None else float(cfg.min_samples), 0.5)
    return inst.hold_time_now_s, 1.0 / math.sqrt(done)


def _nixl(inst: InstanceSignals, cfg: PolicyConfig) -> tuple[float | None, float | None]:
    if inst.nixl_xfer_mean_s is not None and inst.nixl_transfers >= cfg.min_samples:
        return inst.nixl_xfer_mean_s, count_rse(inst.nixl_transfers)
    return None, None


def _prefill_work(inst: InstanceSignals, cfg: PolicyConfig) -> tuple[float | None, float | None]:
    """P's own time per request without its queue: vLLM's mean TTFT less its mean queue time over the
    window (a P request is one token, so its TTFT is queue + prefill). How fast it works, not how
    busy it is."""
    if (
        inst.role == "prefill"
        and inst.ttft_mean_s is not None
        and inst.queue_mean_s is not None
        and inst.requests >= cfg.min_samples
    ):
        return max(0.0, inst.ttft_mean_s - inst.queue_mean_s), count_rse(inst.requests)
    return None, None


def _ttft_now(inst: InstanceSignals, cfg: PolicyConfig) -> tuple[float | None, float | None]:
    if inst.ttft_recent_s is not None and inst.ttft_recent_count >= cfg.min_recent_samples:
        return inst.ttft_recent_s, count_rse(inst.ttft_recent_count)
    return None, None


def _nixl_now(inst: InstanceSignals, cfg: PolicyConfig) -> tuple[float | None, float | None]:
    if inst.nixl_recent_s is not None and inst.nixl_recent_count >= cfg.min_recent_samples:
        return inst.nixl_recent_s, count_rse(inst.nixl_recent_count)
    return None, None


def error_events(inst: InstanceSignals, window_s: float) -> float:
    """Failed NIXL transfers (its own counter) plus, for D, the lease expiries attributed to it, in
    the window."""
    events = inst.failed_transfers_per_min * window_s / 60.0
    if inst.role == "decode":
        events += inst.lease_expiry_suspects
    return events


Measure = Callable[[InstanceSignals, PolicyConfig], tuple[float | None, float | None]]


@dataclass(frozen=True)
class _ErrorEvents:
    """A :data:`Measure` of :func:`error_events` over one window (hashable, so a :class:`PeerIndex`
    sorts the pool's counts once)."""

    window_s: float

    def __call__(self, inst: InstanceSignals, cfg: PolicyConfig) -> tuple[float | None, float | None]:
        return error_events(inst, self.window_s), None


def _median_without(ordered: list[float], drop: float | None) -> float | None:
    """The median of ``ordered`` (sorted) with one copy of ``drop`` taken out (None: nothing taken)."""
    if drop is None:
        return median(ordered) if ordered else None
    n = len(ordered) - 1
    if n <= 0:
        return None
    cut = bisect.bisect_left(ordered, drop)

    def at(j: int) -> float:  # the j-th value once ``drop`` is out
        return ordered[j] if j < cut else ordered[j + 1]

    mid = n // 2
    return at(mid) if n % 2 else (at(mid - 1) + at(mid)) / 2.0


class PeerIndex:
    """The up instances of one role, each measure's values and noise sorted once.

    Every instance is scored against the median of the *others*; this gives that median (and the
    median of their noise) without one instance in O(log n), where rebuilding the peers' values
    per instance made a tick O(n²) in the fleet's size."""

    def __init__(self, members: Sequence[InstanceSignals], cfg: PolicyConfig) -> None:
        self._members = members
        self._cfg = cfg
        self._by_measure: dict[Measure, tuple[list[float], list[float], dict[str, tuple[float, float]]]] = {}

    def _sorted(self, pick: Measure) -> tuple[list[float], list[float], dict[str, tuple[float, float]]]:
        got = self._by_measure.get(pick)
        if got is None:
            values: list[float] = []
            rses: list[float] = []
            own: dict[str, tuple[float, float]] = {}
            for m in self._members:
                v, rse = pick(m, self._cfg)
                if v is not None:
                    values.append(float(v))
                    rses.append(rse or 0.0)
                    own[m.name] = (float(v), rse or 0.0)
            values.sort()
            rses.sort()
            got = self._by_measure[pick] = (values, rses, own)
        return got

    def others(self, pick: Measure, name: str) -> tuple[float | None, float | None, int]:
        """``(median value, median noise, count)`` of the members other than ``name`` that have a value."""
        values, rses, own = self._sorted(pick)
        mine = own.get(name)
        if mine is None:
            return _median_without(values, None), _median_without(rses, None), len(values)
        return _median_without(values, mine[0]), _median_without(rses, mine[1]), len(values) - 1


SHARED_NOTE = "is the pool's, not its own"  # an errors note whose peers' common count was set aside
MATRIX_NOTE = "P×D handoff matrix"  # how a handoff score judged by the matrix starts its note
PAIR_NOTE = "the proxies route around the pair"  # ends the note of an end of a blamed pair


def _matrix_handoff(inst: InstanceSignals, matrix: Factorization | None, tol: float) -> Score | None:
    """The handoff score of an instance the window's P×D matrix judges (:mod:`analysis.blame`):
    its row (a P) or column (a D) over the typical pair. A P slow toward every D reads slow in every
    D's handoffs through it, and a D's median over a mix of that P's slow handoffs and the others'
    fast ones flips between the two with the share it got: compared per instance, healthy Ds were cut
    for one P's NIC. Judged by the matrix, only the side whose row or column is slow scores under 1,
    and only once the matrix blames it. None: no matrix, or one that cannot judge ``inst``."""
    if matrix is None:
        return None
    effect = (matrix.prefill if inst.role == "prefill" else matrix.decode).get(inst.name)
    if effect is None or not effect.judged or matrix.typical <= 0:
        return _beside_a_blamed_line(inst, matrix)
    blamed = any(b.side == inst.role and b.name == inst.name for b in matrix.blames)
    pairs = [
        b.name.replace("|", "->")
        for b in matrix.blames
        if b.side == "pair" and inst.name in b.name.split("|")
    ]
    if not blamed and pairs:
        # one slow pair: the link's, not its ends' (each serves its other links well); the proxies route
        # around it by the pair's handoff in the routing table's rates
        note = f"{MATRIX_NOTE}: blames its pair {', '.join(pairs)}, not it: {PAIR_NOTE}"
        return Score("handoff", 1.0, inst.handoff_p50_s, matrix.typical, note)
    line = "row" if inst.role == "prefill" else "column"
    note = (
        f"{MATRIX_NOTE}: its {line} is ×{effect.ratio:.2f} the typical pair's {matrix.typical:.3f}s "
        f"over {effect.cells} pairs"
    )
    value = min(1.0, tol / effect.ratio) if blamed else 1.0
    return Score("handoff", value, matrix.typical * effect.ratio, matrix.typical, note)


def _beside_a_blamed_line(inst: InstanceSignals, matrix: Factorization) -> Score | None:
    """An instance the matrix cannot judge while it blames a line of the other side (a P's row, for a
    D): its own median mixes that line's slow handoffs with the others' and flips with the share it
    got, which is what cut healthy Ds for one P's NIC; its cells through the other lines are too few
    to judge it (a P cut for its row sends a trickle, so the D's cells thin). Not scored on the
    handoff: its other signals (NIXL time, load, errors) still are. None: no such line."""
    other = "decode" if inst.role == "prefill" else "prefill"
    blamed = sorted(b.name for b in matrix.blames if b.side == other)
    if not blamed:
        return None
    note = (
        f"{MATRIX_NOTE}: cannot judge it, and blames {', '.join(blamed)} on the other side, whose handoffs "
        "its own median mixes in: not scored on the handoff"
    )
    return Score("handoff", 1.0, inst.handoff_p50_s, None, note)


def _unjudged_note(inst: InstanceSignals, matrix: Factorization | None) -> str:
    """Why the matrix left ``inst`` to per-instance evidence, for its handoff note ('' if it did not)."""
    if matrix is None:
        return ""
    why = matrix.why_unjudged.get((inst.role, inst.name), "not in the matrix's fit")
    return f"; per-instance: the {MATRIX_NOTE} cannot judge it ({why})"


def _hopeless(hand: Score, cfg: PolicyConfig) -> Score:
    """A handoff score under 1 whose value alone is over the TTFT target, while its reference is well
    within it, is 0: every request sent there misses the SLO."""
    if (
        hand.value < 1.0
        and hand.observed is not None
        and hand.reference is not None
        and hand.observed > cfg.ttft_target_s
        and hand.reference * cfg.latency_tolerance <= cfg.ttft_target_s
    ):
        return replace(hand, value=0.0, note="handoff p50 s alone over the TTFT target; peers within it")
    return hand


def score_instance(
    inst: InstanceSignals,
    peers: Sequence[InstanceSignals] | PeerIndex,
    cfg: PolicyConfig,
    window_s: float,
    matrix: Factorization | None = None,
) -> tuple[Score, ...]:
    """Score one up instance against its peers: the *other* up instances of its role, given as a
    list or as the :class:`PeerIndex` of all of them (``inst`` itself is left out by name). ``matrix``:
    the window's P×D handoff matrix, which judges the handoff of the instances it can place."""
    tol, fast = cfg.latency_tolerance, cfg.load_tolerance
    index = peers if isinstance(peers, PeerIndex) else PeerIndex(peers, cfg)

    def relative(name: str, pick: Measure, tolerance: float, note: str, floor: float | None = None) -> Score:
        floor = cfg.noise_floor_s if floor is None else floor
        value, rse = pick(inst, cfg)
        ref_median, rse_median, k = index.others(pick, inst.name)
        if ref_median is not None and ref_median < floor:  # the reference is the noise floor, not a sample
            rse_median, k = None, 0
        margin = _margin(rse, rse_median, k, cfg.noise_z)
        s, ref = _score_against(value, ref_median, tolerance, floor, margin)
        return Score(name, s, value, ref, f"{note} vs peers' median (noise margin x{margin:.2f})")

    def speed() -> Score:
        # Clearly slower per request than its peers (past the tolerance and the noise): its share follows
        # its speed, peers' time ÷ its own, whatever its queue. The latency scores shrink as a cut empties
        # its queue, and a P that works at a third of its peers' speed read healthy again at 0.4 and was
        # raised back into its queue; its speed does not change with the share it gets.
        value, rse = _prefill_work(inst, cfg)
        ref, rse_ref, k = index.others(_prefill_work, inst.name)
        margin = _margin(rse, rse_ref, k, cfg.noise_z)
        note = f"prefill s per request (TTFT less queue) vs peers' median (noise margin x{margin:.2f})"
        if value is None or ref is None or ref < cfg.noise_floor_s:
            return Score("speed", 1.0, value, ref, note)
        if value <= ref * tol * max(1.0, margin):
            return Score("speed", 1.0, value, ref, note)
        return Score("speed", min(1.0, ref / value), value, ref, note + ": its share follows its speed")

    scores: list[Score] = []
    if inst.role == "prefill":
        scores.append(relative("ttft", _latency, tol, "queue+prefill s"))
        scores.append(relative("ttft_now", _ttft_now, fast, "vLLM TTFT s over the last 3 scrapes"))
        scores.append(speed())
    hand = _matrix_handoff(inst, matrix, tol)
    if hand is None:
        hand = relative("handoff", _handoff, tol, "handoff p50 s")
        hand = replace(hand, note=hand.note + _unjudged_note(inst, matrix))
    scores.append(_hopeless(hand, cfg))
    what = "running+waiting" if inst.role == "prefill" else "in a KV-fetch stage"
    scores.append(relative("load", _load, fast, f"s: requests {what} ÷ finished per s,", cfg.load_floor_s))
    if inst.role == "decode":
        scores.append(relative("nixl", _nixl, tol, "NIXL xfer s per transfer"))
        scores.append(relative("nixl_now", _nixl_now, fast, "NIXL xfer s over the last 3 scrapes"))
    events, _, _ = index.others(_ErrorEvents(window_s), inst.name)
    failed, _, _ = index.others(_failed_share, inst.name)
    scores.extend(evidence_scores(inst, cfg, window_s, Shared(events or 0.0, failed or 0.0)))
    return tuple(scores)


@dataclass(frozen=True)
class Shared:
    """What an instance's peers show alike, the medians of the others: the pool's, not its own."""

    events: float = 0.0  # failed transfers and attributed expiries in the window (error_events)
    failed_share: float = 0.0  # share of their requests that failed


def _failed_share(inst: InstanceSignals, cfg: PolicyConfig) -> tuple[float | None, float | None]:
    n = max(inst.requests, inst.failed_requests)
    return (inst.failed_requests / n, None) if n > 0 else (None, None)


def own_error_events(events: float, shared: float, cfg: PolicyConfig) -> float:
    """The failures and expiries that are the instance's own: those past ``shared``, the median count
    of its peers, once it counts twice theirs or more and the excess is ``min_error_events`` or more
    and, where they count any, ``noise_z`` standard deviations of the difference of two Poisson
    counts, √(its + theirs) (0 otherwise). A failed pull is counted by the D that pulled it, so one
    P whose transfers fail reads as every D failing, before the records place the failures on the
    P's row (:func:`controller.policy.weights.failure_rows`): the pool's common count is not one
    member's fault, and a cut of every member moves no load. Measured: a margin of √(theirs) alone
    still cut one D in each fleet's run of a failing P, on chance alone."""
    mine, theirs = max(events, 0.0), max(shared, 0.0)
    excess = mine - theirs
    noise = cfg.noise_z * math.sqrt(mine + theirs) if theirs > 0 else 0.0  # peers with none: min_error_events
    needed = max(float(cfg.min_error_events), noise)
    return excess if excess >= needed - 1e-9 and mine >= 2.0 * theirs else 0.0


def evidence_scores(
    inst: InstanceSignals, cfg: PolicyConfig, window_s: float, shared: Shared = Shared()
) -> list[Score]:
    """The absolute signals, facts rather than comparisons with peers: failed transfers and attributed
    lease expiries past what its peers share (:func:`own_error_events`), the instance's own failed
    requests (the lower bound of their share, past the peers' median share), KV usage."""
    scores: list[Score] = []
    events = error_events(inst, window_s)
    per_min = max(window_s / 60.0, 1e-9)
    own = own_error_events(events, shared.events, cfg)
    common = f"; the peers' median {shared.events:.0f} {SHARED_NOTE}" if shared.events > 0 else ""
    scores.append(
        Score(
            "errors",
            error_score(own / per_min, cfg.error_rate_ref_per_min),
            events / per_min,
            cfg.error_rate_ref_per_min,
            f"failed transfers + attributed lease expiries per min ({events:.0f} in the window; they count "
            f"from {cfg.min_error_events}{common})",
        )
    )
    low = (
        failure_fraction_low(inst.failed_requests, inst.requests, cfg.noise_z)
        if inst.failed_requests >= cfg.min_error_events
        else 0.0
    )
    alike = (
        f"; the peers' median share {shared.failed_share:.0%} {SHARED_NOTE}"
        if shared.failed_share > 0
        else ""
    )
    scores.append(
        Score(
            "failures",
            1.0 / (1.0 + max(0.0, low - shared.failed_share) / cfg.failure_ref_fraction),
            low,
            cfg.failure_ref_fraction,
            f"its own failed requests: {inst.failed_requests} of {inst.requests} (lower bound of the share)"
            f"{alike}",
        )
    )
    scores.append(Score("kv", kv_score(inst.kv_usage, cfg), inst.kv_usage, cfg.kv_soft, "KV usage"))
    return scores


def worst(scores: Sequence[Score]) -> Score | None:
    """The lowest score under 1, or None if every signal is healthy."""
    low = min(scores, key=lambda s: s.value, default=None)
    return low if low is not None and low.value < 0.999 else None


def reason_for(score: Score, inst: InstanceSignals) -> Reason:
    if score.name == "handoff" and inst.role == "prefill" and score.note.startswith(MATRIX_NOTE):
        return Reason.SLOW_PREFILL_SIDE
    if (
        score.name == "errors"
        and inst.role == "decode"
        and inst.lease_expiry_suspects
        and (inst.failed_transfers_per_min == 0)
    ):
        return Reason.LEASE_EXPIRIES
    return SIGNAL_REASONS[score.name]
