"""Instance weights: scores -> target -> smoothed -> guarded step, with hysteresis.

Per tick and instance::

    target   = max(min_weight, min(latency scores) × errors × kv)   (0 if the instance is down)
    smoothed = a * target + (1 - a) * smoothed_prev
    weight   moves towards smoothed by at most max_weight_step, and only
             - down, when smoothed < weight - band_down (at once and unsmoothed if target <
               severe_target, else after degrade_ticks ticks in a row, so one noisy window
               moves nothing; a reading from the last-three-scrapes signals alone waits for
               the second tick unless it is extreme), or
             - up,   when smoothed > weight + band_up for recover_ticks ticks in a row,
             so noise inside the bands never changes a weight (no flapping), and a
             degraded instance regains traffic only after it has looked healthy for a while;
             quickly up to the weight a signal last cut it from (its ceiling), past that
             one step per window, so the window sees each new share before the next.

Stale data (the collector is behind) or an instance never scraped in the window holds
the weight: the policy does not act on what it cannot see. An instance whose scrapes fail
is held for ``down_after_s`` (one slow scrape is not an outage), then goes to 0 at once;
when every instance of a role fails at once the weights are held (the observer is the
likelier fault, and all-zero weights would route nothing). Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from statistics import median
from typing import Any

from analysis.blame import Factorization, failing_rows
from controller.policy.config import PolicyConfig
from controller.policy.matrix import handoff_matrix
from controller.policy.scores import (
    MATRIX_NOTE,
    SHARED_NOTE,
    PeerIndex,
    Score,
    error_events,
    reason_for,
    score_instance,
    worst,
)
from controller.policy.signals import InstanceSignals, Observation, Role
from pdscope.reasons import Reason

EPS = 1e-9
LATENCY = ("ttft", "ttft_now", "speed", "handoff", "nixl", "nixl_now", "load")
EVIDENCE = ("errors", "failures", "kv")  # facts, not comparisons: they may cut in a start-up window
# Measured over the last three scrapes only: noisy, so even a severe reading waits for a second tick,
# unless it is extreme (score under this: over 6x the peers' median, e.g. a stuck instance).
FAST = ("ttft_now", "nixl_now", "load")
# What rises on an instance when its pool's load shifts onto it: its queue and its time holding requests
# (not its speed per request, its handoffs, transfers or errors).
LOAD = ("ttft", "ttft_now", "load")
CARRIED = (*LOAD, "speed")  # ... and its speed too, once it finishes clearly more than its peers
SHIFT_NOTE = "left to admission"  # ends the note of a load score set aside because its pool sheds load


@dataclass(frozen=True)
class WeightState:
    """What the policy carries from one tick to the next for one instance."""

    weight: float = 1.0
    smoothed: float = 1.0
    healthy_streak: int = 0
    reason: Reason = Reason.INITIAL
    degraded_streak: int = 0
    lowered_at: float | None = None  # when a signal (or an outage) last lowered the weight: gates probes
    probe_at: float | None = None  # when the last probe raise was given (its first failures cut it back)
    # The weight it had when a signal last cut it: where its trouble showed. A raise back up to it is
    # quick; past it, one step per window, so the window sees it at each new share before the next.
    ceiling: float = 1.0
    raised_at: float | None = None  # when its weight last rose
    cut_for: Reason | None = None  # the reason of the signal that last cut it (None: back at 1)


@dataclass(frozen=True)
class WeightDecision:
    instance: str
    pool: str
    role: Role
    old_weight: float
    weight: float
    target: float | None
    smoothed: float
    reason: Reason
    message: str
    arithmetic: str
    scores: Mapping[str, float] = field(default_factory=dict)
    inputs: Mapping[str, Any] = field(default_factory=dict)
    state: WeightState = WeightState()

    @property
    def changed(self) -> bool:
        return abs(self.weight - self.old_weight) > EPS


def _r(x: float) -> float:
    return round(x, 4)


def _inputs(inst: InstanceSignals, scores: tuple[Score, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "up": inst.up,
        "kv_usage": inst.kv_usage,
        "num_waiting": inst.num_waiting,
        "requests": inst.requests,
        "refused_requests": inst.refused_requests,
        "failed_transfers_per_min": _r(inst.failed_transfers_per_min),
        "expired_leases_per_min": _r(inst.expired_leases_per_min),
        "lease_expiry_suspects": inst.lease_expiry_suspects,
        "failed_requests": inst.failed_requests,
        "unattributed_lease_expiries": inst.unattributed_lease_expiries,
    }
    for s in scores:
        out[f"{s.name}_observed"] = None if s.observed is None else _r(s.observed)
        out[f"{s.name}_reference"] = None if s.reference is None else _r(s.reference)
        if s.name == "handoff":  # judged by the P×D matrix, or per instance and why
            out["handoff_basis"] = s.note
        if s.name in (*CARRIED, "handoff") and s.note.endswith(SHIFT_NOTE):  # its pool shed load onto it
            out[f"{s.name}_load_shift"] = s.note
        if s.name in MIXED and s.note.endswith(MIXED_NOTE):  # beside a P-side fault: not the D's
            out[f"{s.name}_mixed"] = s.note
        if s.name in ("errors", "failures") and SHARED_NOTE in s.note:  # what its peers count too
            out[f"{s.name}_basis"] = s.note
    return out


def _hold(inst: InstanceSignals, prev: WeightState, reason: Reason, message: str) -> WeightDecision:
    return WeightDecision(
        instance=inst.name,
        pool=inst.pool,
        role=inst.role,
        old_weight=prev.weight,
        weight=prev.weight,
        target=None,
        smoothed=prev.smoothed,
        reason=reason,
        message=message,
        arithmetic=f"weight = {prev.weight:.2f} (held)",
        inputs={"up": inst.up, "last_seen": inst.last_seen},
        state=replace(prev, healthy_streak=0, reason=reason, degraded_streak=0),
    )


@dataclass
class _Step:
    """One tick's draft for one up instance: what the branch of :func:`step_instance` taken decides."""

    w: float  # the weight now
    target: float
    smoothed: float
    low: Score | None  # the worst signal, if any is under 1
    probe_at: float | None
    lowered_at: float | None
    arith: list[str]
    new: float = 0.0
    reason: Reason = Reason.HEALTHY
    what: str = ""
    streak: int = 0
    degraded: int = 0


def step_instance(
    inst: InstanceSignals,
    peers: Sequence[InstanceSignals] | PeerIndex,
    prev: WeightState,
    cfg: PolicyConfig,
    window_s: float,
    now: float = 0.0,
    history_s: float | None = None,
    matrix: Factorization | None = None,
    shed: Sequence[str] = (),
    slow_ps: Sequence[str] = (),
    handoffs: int | None = None,
) -> WeightDecision:
    """One tick for one instance whose data is fresh (``matrix``: the window's P×D handoff matrix;
    ``shed``: the members of its pool that are down, cut or avoided, whose load the others took;
    ``slow_ps``: the Ps slow or failing on their own side, whose pulls a D's means mix in;
    ``handoffs``: for a P last cut on its handoff side, its handoffs that reached a first token in the
    window, the evidence a raise needs: its prefill requests say nothing of that side)."""
    unseen = _not_up(inst, prev, cfg, now)
    if unseen is not None:
        return unseen
    warming = history_s is not None and history_s < cfg.startup_s
    scores = _scores(inst, peers, cfg, window_s, warming, matrix)
    if shed:
        index = peers if isinstance(peers, PeerIndex) else PeerIndex(peers, cfg)
        scores = shifted_load(scores, inst, index, shed, cfg)
    if slow_ps and inst.role == "decode":
        scores = mixed_transfers(scores, slow_ps)
    st = _draft(scores, prev, cfg, now)
    w = st.w
    band_down = min(cfg.band_down, max(0.0, w - cfg.min_weight) - EPS)
    band_up = min(cfg.band_up, max(0.0, 1.0 - w) - EPS)
    probing = st.probe_at is not None
    failing = inst.failed_requests > 0 or error_events(inst, window_s) > 0
    if w < cfg.min_weight:  # back from down or drained: start at the floor; the way up is a probe
        _from_floor(st, cfg, now)
    elif probing and failing:
        _probe_failed(st, inst, cfg, window_s, now)
    elif st.smoothed < w - band_down and band_down > 0 and st.target < w - band_down:
        _lower(st, inst, prev, cfg)
    elif st.smoothed > w + band_up and band_up > 0 and not _has_evidence(inst, w, cfg, handoffs):
        _probe_or_wait(st, inst, cfg, now, handoffs)
    elif st.smoothed > w + band_up and band_up > 0:
        _raise(st, prev, cfg, window_s, now)
    else:
        _in_bands(st, inst, cfg, warming, history_s)
    return _decision(inst, prev, st, scores, cfg, now)


def _not_up(inst: InstanceSignals, prev: WeightState, cfg: PolicyConfig, now: float) -> WeightDecision | None:
    """The decision for an instance not seen up at the latest scrape (held, or down); None if it is up."""
    if inst.up is None:
        return _hold(
            inst,
            prev,
            Reason.NO_DATA,
            f"{inst.name}: not scraped in the window; weight held at {prev.weight:.2f}",
        )
    unreachable = inst.unreachable_scrapes >= cfg.down_after_unreachable
    if inst.up is False and (inst.down_for_s or 0.0) < cfg.down_after_s and not unreachable:
        return _hold(
            inst,
            prev,
            Reason.SCRAPE_FAILING,
            f"{inst.name}: scrapes failing for {inst.down_for_s or 0.0:.1f}s (down after "
            f"{cfg.down_after_s:.0f}s, or {cfg.down_after_unreachable} unreachable scrapes in a row); "
            f"weight held at {prev.weight:.2f}",
        )
    return _down(inst, prev, now) if inst.up is False else None


def _down(inst: InstanceSignals, prev: WeightState, now: float) -> WeightDecision:
    """Down is a cut like any other: the way back is a probe, judged by evidence (an outage says
    nothing of the share it can take: no ceiling)."""
    st = WeightState(
        0.0, 0.0, 0, Reason.INSTANCE_DOWN, 0, now if prev.weight > 0 else prev.lowered_at, None, 1.0
    )
    return WeightDecision(
        instance=inst.name,
        pool=inst.pool,
        role=inst.role,
        old_weight=prev.weight,
        weight=0.0,
        target=0.0,
        smoothed=0.0,
        reason=Reason.INSTANCE_DOWN,
        message=f"{inst.name}: down at the latest scrape{_down_why(inst)}; no new work",
        arithmetic="weight = 0 (up = 0)",
        scores={"up": 0.0},
        inputs={
            "up": False,
            "last_seen": inst.last_seen,
            "down_for_s": inst.down_for_s,
            "unreachable_scrapes": inst.unreachable_scrapes,
        },
        state=st,
    )


def _down_why(inst: InstanceSignals) -> str:
    if inst.unreachable_scrapes:
        return f" (its last {inst.unreachable_scrapes} scrapes could not connect: nothing listens)"
    return f" (scrapes failing for {inst.down_for_s or 0.0:.1f}s)"


def _scores(
    inst: InstanceSignals,
    peers: Sequence[InstanceSignals] | PeerIndex,
    cfg: PolicyConfig,
    window_s: float,
    warming: bool,
    matrix: Factorization | None = None,
) -> tuple[Score, ...]:
    scores = score_instance(inst, peers, cfg, window_s, matrix)
    if warming:  # a start-up window: too little history to compare against, only facts may cut
        scores = tuple(
            s
            if s.name in EVIDENCE or s.value >= 1.0
            else replace(s, value=1.0, note=f"{s.note}; {s.value:.2f} in a start-up window: not acted on")
            for s in scores
        )
    return scores


def _done(inst: InstanceSignals, cfg: PolicyConfig) -> tuple[float | None, float | None]:
    return inst.load_done, None


def shifted_load(
    scores: tuple[Score, ...], inst: InstanceSignals, peers: PeerIndex, shed: Sequence[str], cfg: PolicyConfig
) -> tuple[Score, ...]:
    """Issue 29's third rule. When members of a pool are down, cut or avoided (:func:`shedding`), the
    others take their load: their queues and hold times rise from it, not from a fault, and cutting
    them for it only shifts the same load on again. So an instance that finishes work at least at its
    peers' pace (within the latency tolerance) is not cut on its load signals (:data:`LOAD`) while
    its pool sheds load; admission is what answers a pool short of capacity. One that finishes less
    than that (a stuck one finishes nothing) is judged as before, and its handoffs, transfers and
    errors always are. Its speed per request (TTFT less queue), and a D's handoff, are set aside only
    once it finishes more than ``latency_tolerance`` times its peers' work: continuous batching makes a P that
    carries twice the load slower per request, and a 2P fleet whose other P was cut for failing
    transfers cut the healthy one on it; a P slow per request while it finishes what its peers do is
    slow, not loaded."""
    done, _ = _done(inst, cfg)
    ref, _, _ = peers.others(_done, inst.name)
    if done is None or ref is None or done * cfg.latency_tolerance < ref:
        return scores
    why = (
        f"from the load {', '.join(shed)} shed (down, cut or avoided; it finishes {done:.0f} to its "
        f"peers' {ref:.0f}): {SHIFT_NOTE}"
    )
    if done < ref * cfg.latency_tolerance:
        return _set_aside(scores, LOAD, why)
    # it carries clearly more than its peers: its speed too, and a D's handoff, which holds its queue
    # for a batch slot (judged by the matrix or not); one that finishes what its peers do and hands
    # off slowly is slow, not loaded (a second D fault while the first is cut)
    if inst.role == "decode":
        return _set_aside(scores, (*CARRIED, "handoff"), why, matrix_too=True)
    return _set_aside(scores, CARRIED, why)


def _set_aside(
    scores: tuple[Score, ...], names: Sequence[str], why: str, matrix_too: bool = False
) -> tuple[Score, ...]:
    """``scores`` with those named in ``names`` that would cut scored 1, their note saying ``why`` (a
    handoff judged by the P×D matrix keeps its score unless ``matrix_too``: the matrix already placed
    its slowness on a side)."""
    return tuple(
        replace(s, value=1.0, note=f"{s.note}; {s.value:.2f} {why}")
        if s.name in names
        and s.value < 1.0
        and (matrix_too or not (s.name == "handoff" and s.note.startswith(MATRIX_NOTE)))
        else s
        for s in scores
    )


# A D's signals over the transfers of every P it pulls from (vLLM's NIXL histograms carry no P label)
MIXED = ("handoff", "nixl", "nixl_now", "load")
P_SIDE = (Reason.SLOW_HANDOFF, Reason.SLOW_PREFILL_SIDE, Reason.TRANSFER_FAILURES)
MIXED_NOTE = "not the D's evidence"  # ends the note of a D's signal set aside beside a P-side fault


def mixed_transfers(scores: tuple[Score, ...], slow_ps: Sequence[str]) -> tuple[Score, ...]:
    """A D's transfer signals while a P's handoffs are slow or failing toward every D (``slow_ps``,
    :func:`p_side_faults`): its NIXL time, its KV-fetch hold time and its own handoff median are means
    over the pulls from every P, so they read as slow as the share of that P's pulls it happened to
    get, and healthy Ds were cut on `SlowKVTransfer` for one P's NIC. Set aside, with why; a handoff
    the P×D matrix judged (its column against the typical pair) and its errors, failures and KV
    still count."""
    why = (
        f"but it mixes the transfers of {', '.join(slow_ps)}, slow or failing on their side or their link to "
        f"it: {MIXED_NOTE}"
    )
    return _set_aside(scores, MIXED, why)


def pair_ends(matrix: Factorization | None) -> dict[str, list[str]]:
    """Per instance at an end of a pair the matrix blames, the other ends: the proxies route around the
    pair, so its P's and D's load moves to the others (:func:`shedding`), and the D's transfer means mix
    the pair's slow pulls (:func:`mixed_transfers`)."""
    out: dict[str, list[str]] = {}
    for b in matrix.blames if matrix is not None else ():
        if b.side == "pair":
            p, _, d = b.name.partition("|")
            out.setdefault(p, []).append(d)
            out.setdefault(d, []).append(p)
    return out


def p_side_faults(
    obs: Observation, prev: Mapping[str, WeightState], matrix: Factorization | None
) -> list[str]:
    """The Ps whose handoffs are slow or failing toward the Ds: blamed on their row by the window's
    matrix, or whose weight a handoff or transfer signal cut and is still under 1."""
    out = {b.name for b in matrix.blames if b.side == "prefill"} if matrix is not None else set()
    for inst in obs.instances:
        state = prev.get(inst.name)
        if (
            inst.role == "prefill"
            and state is not None
            and state.cut_for in P_SIDE
            and state.weight < 1.0 - EPS
        ):
            out.add(inst.name)
    return sorted(out)


def shedding(
    obs: Observation, prev: Mapping[str, WeightState], cfg: PolicyConfig, ends: Mapping[str, list[str]] = {}
) -> dict[str, list[str]]:
    """Per pool, its members whose load is on the others: down, cut, served less than half the
    requests of the pool's median member in the window (the proxies route by prediction and avoid an
    instance before any weight is cut: a P whose NIC slowed got none of a 2P+4D fleet's requests
    while its weight was still 1, and its peer's queue doubled), or at an end of a blamed pair
    (``ends``, :func:`pair_ends`: a 4P+2D fleet's proxies left one P's link to one D, and two healthy
    Ps were cut on `SlowPrefill` for the load it moved)."""
    served: dict[str, list[int]] = {}
    for inst in obs.instances:
        if inst.up:
            served.setdefault(inst.pool, []).append(inst.requests)
    typical = {pool: median(n) for pool, n in served.items()}
    out: dict[str, list[str]] = {}
    for inst in obs.instances:
        ref = typical.get(inst.pool, 0.0)
        avoided = inst.up is True and ref >= cfg.min_samples and inst.requests < ref / 2.0
        cut = prev.get(inst.name, WeightState()).weight < 1.0 - EPS
        if inst.up is False or avoided or cut or inst.name in ends:
            out.setdefault(inst.pool, []).append(inst.name)
    return out


def _draft(scores: tuple[Score, ...], prev: WeightState, cfg: PolicyConfig, now: float) -> _Step:
    """Target (the worst latency view times the other scores, floored) and its smoothing."""
    latency = [s for s in scores if s.name in LATENCY]
    other = [s for s in scores if s.name not in LATENCY]
    product = min((s.value for s in latency), default=1.0)
    for s in other:
        product *= s.value
    target = max(cfg.min_weight, product)
    a = cfg.smoothing
    smoothed = a * target + (1.0 - a) * prev.smoothed
    if abs(smoothed - target) < cfg.snap:  # an EWMA never arrives; close enough is there
        smoothed = target
    lat_terms = ", ".join(f"{s.name} {s.value:.2f}" for s in latency)
    terms = " × ".join([f"min({lat_terms})"] + [f"{s.name} {s.value:.2f}" for s in other])
    arith = [
        f"target = max({cfg.min_weight:.2f}, {terms}) = {target:.2f}",
        f"smoothed = {a:.2f}×{target:.2f} + {1 - a:.2f}×{prev.smoothed:.2f} = {smoothed:.2f}",
    ]
    w = prev.weight
    probing = (
        prev.probe_at is not None and now - prev.probe_at <= cfg.probe_hold_s and w <= cfg.probe_weight + EPS
    )
    return _Step(
        w=w,
        target=target,
        smoothed=smoothed,
        low=worst(scores),
        probe_at=prev.probe_at if probing else None,
        lowered_at=prev.lowered_at,
        arith=arith,
        new=w,
    )


def _from_floor(st: _Step, cfg: PolicyConfig, now: float) -> None:
    st.new = cfg.min_weight
    st.arith.append(f"weight = min_weight {cfg.min_weight:.2f} (was {st.w:.2f}, instance is up)")
    st.reason, st.what = (
        Reason.INSTANCE_UP,
        "up again; starts at the floor (a probe, then evidence, raises it)",
    )
    # Its outage is over: it may be probed at once (not after probe_after_s at the floor).
    st.lowered_at = now - cfg.probe_after_s


def _probe_failed(st: _Step, inst: InstanceSignals, cfg: PolicyConfig, window_s: float, now: float) -> None:
    """A probe is a probe: its first failures end it, back to the floor at once, and the wait starts again."""
    st.new = cfg.min_weight
    st.smoothed = min(st.smoothed, st.target)
    st.arith.append(
        f"weight = min_weight {cfg.min_weight:.2f} (probe failed: {inst.failed_requests} failed "
        f"requests, {error_events(inst, window_s):.0f} transfer failures/expiries)"
    )
    st.reason, st.what = Reason.PROBE_FAILED, "failed while probed; back to the floor"
    st.probe_at, st.lowered_at = None, now


def _lower(st: _Step, inst: InstanceSignals, prev: WeightState, cfg: PolicyConfig) -> None:
    w, low = st.w, st.low
    st.degraded = prev.degraded_streak + 1
    st.reason = reason_for(low, inst) if low is not None else Reason.DEGRADED
    st.what = _describe(low) if low is not None else "smoothed target below the weight"
    unconfirmed = low is not None and low.name in FAST and low.value >= cfg.extreme_score
    if st.target < cfg.severe_target and (not unconfirmed or st.degraded >= cfg.degrade_ticks):
        # Severe: act on the target itself; the EWMA would take ticks to get there.
        st.smoothed = st.target
        st.new = max(st.target, w - cfg.max_weight_step, cfg.min_weight)
        st.arith.append(
            f"weight = max(target {st.target:.2f} (severe, under {cfg.severe_target:.2f}: not "
            f"smoothed), {w:.2f} - {cfg.max_weight_step:.2f}, {cfg.min_weight:.2f}) = {st.new:.2f}"
        )
    elif st.degraded >= cfg.degrade_ticks:
        st.new = max(st.smoothed, w - cfg.max_weight_step, cfg.min_weight)
        st.arith.append(
            f"weight = max({st.smoothed:.2f}, {w:.2f} - {cfg.max_weight_step:.2f}, "
            f"{cfg.min_weight:.2f}) = {st.new:.2f}"
        )
    else:
        st.new = w
        st.arith.append(f"weight = {w:.2f} (mild: confirming, {st.degraded}/{cfg.degrade_ticks} ticks)")
        st.what = f"{st.what} (confirming {st.degraded}/{cfg.degrade_ticks})"


def _probe_or_wait(
    st: _Step, inst: InstanceSignals, cfg: PolicyConfig, now: float, handoffs: int | None = None
) -> None:
    """Looks healthy only because too few requests reach it to show anything: no evidence. Once it has
    waited probe_after_s at the low weight it gets a probe: a small, bounded share, never a ramp."""
    w = st.w
    seen = (
        f"{inst.requests} requests" if handoffs is None else f"{handoffs} handoffs (cut on its handoff side)"
    )
    since = now - (st.lowered_at if st.lowered_at is not None else now - cfg.probe_after_s)
    if w < cfg.probe_weight - EPS and since >= cfg.probe_after_s:
        st.new = min(cfg.probe_weight, w + cfg.max_weight_step)
        st.arith.append(
            f"weight = min(probe {cfg.probe_weight:.2f}, {w:.2f} + {cfg.max_weight_step:.2f}) = "
            f"{st.new:.2f} (a probe: {seen} in the window, too few to judge)"
        )
        st.reason, st.what = Reason.PROBING, f"too few requests to judge; probed with weight {st.new:.2f}"
        st.probe_at = now
        return
    st.new = w
    wait = max(0.0, cfg.probe_after_s - since)
    st.arith.append(
        f"weight = {w:.2f} ({seen}, {inst.nixl_transfers:.0f} transfers in the "
        f"window: too few to judge; raises past {cfg.probe_weight:.2f} need evidence)"
    )
    st.reason = Reason.AWAITING_EVIDENCE
    st.what = f"too few requests at weight {w:.2f} to judge" + (
        f"; probing in {wait:.0f}s" if w < cfg.probe_weight - EPS else ""
    )


def _raise(st: _Step, prev: WeightState, cfg: PolicyConfig, window_s: float, now: float) -> None:
    w, smoothed = st.w, st.smoothed
    st.streak = streak = prev.healthy_streak + 1
    if streak >= cfg.recover_ticks and w < cfg.probe_weight - EPS:
        # From under the probe weight the first step is a probe, whatever the evidence so far.
        st.new = min(smoothed, cfg.probe_weight)
        st.arith.append(
            f"weight = min({smoothed:.2f}, probe {cfg.probe_weight:.2f}) = {st.new:.2f} after "
            f"{streak} healthy ticks (a probe first)"
        )
        st.reason, st.what = Reason.PROBING, f"healthy for {streak} ticks; probed with weight {st.new:.2f}"
        st.probe_at = now
    elif (
        streak >= cfg.recover_ticks
        and w >= prev.ceiling - EPS
        and prev.raised_at is not None
        and (now - prev.raised_at < window_s)
    ):
        # Past where it was last cut: the window has not yet seen it at this share.
        st.new = w
        st.arith.append(
            f"weight = {w:.2f} (at or above {prev.ceiling:.2f}, where it was last cut: raised "
            f"{now - prev.raised_at:.0f}s ago, the next step after a {window_s:.0f}s window)"
        )
        st.reason = Reason.HOLDING_AFTER_RAISE
        st.what = (
            f"healthy, at or above {prev.ceiling:.2f} where it was last cut; one step per "
            f"{window_s:.0f}s window"
        )
    elif streak >= cfg.recover_ticks:
        step_to = min(smoothed, w + cfg.max_weight_step, 1.0)
        st.new = min(step_to, prev.ceiling) if w < prev.ceiling - EPS else step_to
        capped = f", back to {prev.ceiling:.2f} where it was last cut" if st.new < step_to - EPS else ""
        st.arith.append(
            f"weight = min({smoothed:.2f}, {w:.2f} + {cfg.max_weight_step:.2f}, 1{capped}) = "
            f"{st.new:.2f} after {streak} healthy ticks"
        )
        st.reason, st.what = Reason.RECOVERING, f"healthy for {streak} ticks"
    else:
        st.new = w
        st.arith.append(f"weight = {w:.2f} (healthy {streak}/{cfg.recover_ticks} ticks before raising)")
        st.reason, st.what = Reason.HOLDING_FOR_HYSTERESIS, f"healthy {streak}/{cfg.recover_ticks} ticks"


def _in_bands(
    st: _Step, inst: InstanceSignals, cfg: PolicyConfig, warming: bool, history_s: float | None
) -> None:
    w, low = st.w, st.low
    st.new = w
    st.arith.append(
        f"weight = {w:.2f} (|smoothed - weight| inside bands -{cfg.band_down:.2f}/+{cfg.band_up:.2f})"
    )
    if low is not None and w < 1.0 - EPS:
        st.reason, st.what = reason_for(low, inst), _describe(low)
    elif w < 1.0 - EPS:
        st.reason, st.what = Reason.STEADY, "inside the hysteresis bands"
    elif inst.unattributed_lease_expiries:
        st.reason = Reason.UNATTRIBUTED_LEASE_EXPIRIES
        st.what = (
            f"{inst.unattributed_lease_expiries} of its leases expired with no waiting handoff to explain "
            "them; no instance is charged"
        )
    elif warming:
        st.reason = Reason.WARMING_UP
        st.what = f"start-up window ({history_s or 0:.0f}s of history): only failures may cut"
    else:
        st.reason, st.what = Reason.HEALTHY, "every signal healthy"


def _decision(
    inst: InstanceSignals,
    prev: WeightState,
    st: _Step,
    scores: tuple[Score, ...],
    cfg: PolicyConfig,
    now: float,
) -> WeightDecision:
    w = st.w
    new = _r(min(1.0, max(cfg.min_weight, st.new)))
    msg = (
        f"{inst.name}: {st.what}; weight {w:.2f} -> {new:.2f}"
        if abs(new - w) > EPS
        else (f"{inst.name}: {st.what}; weight stays {w:.2f}")
    )
    lowered_at = now if new < w - EPS and st.reason != Reason.PROBE_FAILED else st.lowered_at
    return WeightDecision(
        instance=inst.name,
        pool=inst.pool,
        role=inst.role,
        old_weight=w,
        weight=new,
        target=_r(st.target),
        smoothed=_r(st.smoothed),
        reason=st.reason,
        message=msg,
        arithmetic="; ".join(st.arith),
        scores={s.name: _r(s.value) for s in scores},
        inputs=_inputs(inst, scores),
        state=WeightState(
            new,
            st.smoothed,
            st.streak,
            st.reason,
            st.degraded,
            lowered_at,
            st.probe_at,
            _ceiling_after(prev, w, new, st.reason),
            now if new > w + EPS else prev.raised_at,
            _cut_for_after(prev, w, new, st.reason),
        ),
    )


def _cut_for_after(prev: WeightState, w: float, new: float, reason: Reason) -> Reason | None:
    """What a cut on a signal was for, kept while the weight is under 1 (as the ceiling is)."""
    if new >= 1.0 - EPS:
        return None
    if new < w - EPS and reason not in (Reason.PROBE_FAILED, Reason.INSTANCE_UP):
        return reason
    return prev.cut_for


def _ceiling_after(prev: WeightState, w: float, new: float, reason: Reason) -> float:
    """A cut on a signal sets the ceiling to the weight it was cut from; a failed probe and a raise keep it;
    a weight back at 1 has none."""
    if new >= 1.0 - EPS:
        return 1.0
    if new < w - EPS and reason not in (Reason.PROBE_FAILED, Reason.INSTANCE_UP):
        return w
    return prev.ceiling


def _has_evidence(inst: InstanceSignals, w: float, cfg: PolicyConfig, handoffs: int | None = None) -> bool:
    """Whether a healthy-looking tick counts towards a raise: enough requests (or transfers) to judge;
    for a P cut on its handoff side, enough of its handoffs (``handoffs``). Its prefill requests finish
    in time while the handoffs they begin are still on the slow link: a P whose NIC slowed tenfold was
    raised on three of them, none yet pulled, and the proxies' next requests through it were all late
    (a simulated 2P+4D fleet at 90 % load).

    At or under the probe weight, fewer judge (a probe's share is small): ``probe_min_requests``."""
    need = cfg.min_samples if w > cfg.probe_weight + EPS else min(cfg.min_samples, cfg.probe_min_requests)
    if handoffs is not None:
        return handoffs >= need
    return inst.requests >= need or inst.nixl_transfers >= need


def _describe(s: Score) -> str:
    if s.name == "handoff" and s.note.startswith(MATRIX_NOTE):
        return s.note
    if s.name == "handoff" and s.value == 0.0 and s.observed is not None:
        return (
            f"handoff {s.observed:.3f}s alone is over the TTFT target (peers' median {s.reference or 0:.3f}s)"
        )
    if s.name == "load" and s.reference is not None and s.observed is not None:
        return (
            f"a request spends {s.observed:.2f}s there now (held ÷ finished per s) vs peers' median "
            f"{s.reference:.2f}s"
        )
    if s.reference is not None and s.observed is not None and s.name in LATENCY:
        ratio = s.observed / s.reference if s.reference else float("inf")
        return f"{s.name} {s.observed:.3f}s is {ratio:.1f}x its peers' median {s.reference:.3f}s"
    if s.name == "errors":
        return f"{s.observed or 0:.1f} failed transfers/lease expiries per min"
    if s.name == "kv":
        return f"KV usage {100 * (s.observed or 0):.0f}%"
    return f"{s.name} score {s.value:.2f}"


def _unjudgeable(
    inst: InstanceSignals, p: WeightState, age: float | None, stale: bool, unobservable: bool
) -> WeightDecision | None:
    """The hold of an instance the tick cannot judge: the data is stale, or every instance of its role
    fails its scrapes at once (far more often the collector or its network than the fleet; all-zero
    weights would also route nothing). None: it can be judged."""
    if stale:
        what = "no snapshots at all" if age is None else f"newest snapshot {age:.0f}s old"
        message = f"{inst.name}: {what} (collector behind); weight held at {p.weight:.2f}"
        return _hold(inst, p, Reason.STALE_DATA, message)
    if inst.up is False and unobservable:
        message = (
            f"{inst.name}: every {inst.role} instance fails its scrapes (collector or network?); weight "
            f"held at {p.weight:.2f}"
        )
        return _hold(inst, p, Reason.ROLE_UNOBSERVABLE, message)
    return None


def decide_weights(
    obs: Observation, prev: Mapping[str, WeightState], cfg: PolicyConfig
) -> tuple[WeightDecision, ...]:
    """Weights for every observed instance. Stale data holds every weight."""
    age = obs.data_age_s
    stale = age is None or age > cfg.stale_after_s
    out: list[WeightDecision] = []
    obs, basis = failure_rows(obs, cfg)
    by_role: dict[str, list[InstanceSignals]] = {}
    for o in obs.instances:
        by_role.setdefault(o.role, []).append(o)
    unobservable = {r for r, members in by_role.items() if all(o.up is False for o in members)}
    # each role's up instances, indexed once: every instance is scored against the others
    peers = {r: PeerIndex([o for o in members if o.up], cfg) for r, members in by_role.items()}
    matrix = handoff_matrix(obs, cfg)
    ends = pair_ends(matrix)
    shed = shedding(obs, prev, cfg, ends)
    slow_ps = p_side_faults(obs, prev, matrix)
    handed = handoffs_through(obs)
    for inst in obs.instances:
        p = prev.get(inst.name, WeightState())
        held = _unjudgeable(inst, p, age if stale else None, stale, inst.role in unobservable)
        if held is not None:
            out.append(held)
            continue
        others = [n for n in shed.get(inst.pool, ()) if n != inst.name]
        beside = slow_ps + ends.get(inst.name, []) if inst.role == "decode" else slow_ps
        handoffs = handed.get(inst.name, 0) if inst.role == "prefill" and p.cut_for in P_SIDE else None
        out.append(
            step_instance(
                inst,
                peers[inst.role],
                p,
                cfg,
                obs.window_s,
                obs.now,
                obs.history_s,
                matrix,
                others,
                beside,
                handoffs,
            )
        )
    return _annotated(out, obs, basis)


def handoffs_through(obs: Observation) -> dict[str, int]:
    """Per P, its handoffs in the window that reached a first token (the pairs' charged handoffs)."""
    out: dict[str, int] = {}
    for pair in obs.pairs:
        out[pair.p_instance] = out.get(pair.p_instance, 0) + pair.requests
    return out


def _annotated(
    out: Sequence[WeightDecision], obs: Observation, basis: Mapping[str, str]
) -> tuple[WeightDecision, ...]:
    """What the observation left out or could not attribute, on every decision it shaped; and where a
    failure was moved along a P's row, what was moved."""
    extra = {
        "untrusted_records": obs.untrusted_records,
        "unattributed_lease_expiries": obs.unattributed_lease_expiries,
    }
    return tuple(
        replace(
            d,
            inputs={
                **d.inputs,
                **extra,
                **({"failures_basis": basis[d.instance]} if d.instance in basis else {}),
            },
        )
        for d in out
    )


def _move_failures(
    inst: InstanceSignals, rows: Mapping[str, str], failures: Mapping[tuple[str, str], int], per_min: float
) -> tuple[InstanceSignals, str]:
    """``inst`` charged its row's failures (a row P), or relieved of the ones a row P's handoffs brought
    it (a D); and what was moved ('' for nothing)."""
    if inst.name in rows:
        own = sum(n for (p, _), n in failures.items() if p == inst.name)
        moved = replace(inst, failed_transfers_per_min=inst.failed_transfers_per_min + own / per_min)
        return moved, f"charged its row: {rows[inst.name]}"
    theirs = sum(n for (p, d), n in failures.items() if d == inst.name and p in rows)
    mine = sum(n for (_, d), n in failures.items() if d == inst.name)
    if inst.role != "decode" or not theirs or not mine:
        return inst, ""
    keep = 1.0 - theirs / mine
    moved = replace(
        inst,
        failed_transfers_per_min=inst.failed_transfers_per_min * keep,
        failed_requests=round(inst.failed_requests * keep),
        lease_expiry_suspects=round(inst.lease_expiry_suspects * keep),
    )
    return moved, (
        f"{theirs} of its {mine} failed or expired handoffs are the row of {', '.join(sorted(rows))}: "
        "not charged to it"
    )


def failure_rows(obs: Observation, cfg: PolicyConfig) -> tuple[Observation, dict[str, str]]:
    """A P whose handoffs fail toward every D (:func:`analysis.blame.failing_rows`) is charged its
    row's failures, and each D is relieved of the ones it pulled from that P: a failed pull is counted
    by the D, so a P-side fault read as every D failing and cut them all. Returns the observation
    with those signals moved, and per instance moved, what was moved (its decision's
    ``inputs.failures_basis``)."""
    failures = {(x.p_instance, x.d_instance): x.failures for x in obs.pairs if x.failures}
    if not failures:
        return obs, {}
    rows = failing_rows(
        failures, {(x.p_instance, x.d_instance): x.requests for x in obs.pairs}, cfg.min_error_events
    )
    if not rows:
        return obs, {}
    per_min = max(obs.window_s / 60.0, 1e-9)
    basis: dict[str, str] = {}
    moved: list[InstanceSignals] = []
    for inst in obs.instances:
        inst, why = _move_failures(inst, rows, failures, per_min)
        if why:
            basis[inst.name] = why
        moved.append(inst)
    return replace(obs, instances=tuple(moved)), basis
