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
  transfers plus the expired leases the collector attributed to requests sent to it: P
  counts expiries, but a D that does not pull in time causes them), ``kv``.

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from statistics import median

from controller.policy.config import PolicyConfig
from controller.policy.signals import InstanceSignals

# Below this many seconds, latency differences are noise, not a signal.
NOISE_FLOOR_S = 0.005
# Below this many seconds, differences in the time a request spends at an instance now are noise:
# it is a ratio of small counts over three scrapes (3 held / 5 finished in 3 s is 1.8 s).
LOAD_FLOOR_S = 1.0

SIGNAL_REASONS = {
    "ttft": "SlowPrefill",
    "handoff": "SlowHandoff",
    "nixl": "SlowKVTransfer",
    "ttft_now": "SlowPrefill",
    "nixl_now": "SlowKVTransfer",
    "load": "Backlog",
    "errors": "TransferFailures",
    "kv": "KVCachePressure",
}


@dataclass(frozen=True)
class Score:
    """One signal's score with what it was computed from, for the decision record."""

    name: str
    value: float
    observed: float | None
    reference: float | None
    note: str


def relative_score(
    value: float | None, peers: Sequence[float], tolerance: float, floor: float = NOISE_FLOOR_S
) -> tuple[float, float | None]:
    """``(score, reference)``: 1 within ``tolerance`` x the peers' median, else ref*tol/value."""
    if value is None or not peers:
        return 1.0, None
    ref = max(median(peers), floor)
    if value <= ref * tolerance:
        return 1.0, ref
    return min(1.0, ref * tolerance / value), ref


def error_score(rate_per_min: float, ref_per_min: float) -> float:
    """1 with no errors, 0.5 at ``ref_per_min``, towards 0 as errors grow."""
    return 1.0 / (1.0 + max(0.0, rate_per_min) / ref_per_min)


def kv_score(usage: float | None, cfg: PolicyConfig) -> float:
    """1 up to ``kv_soft``, falling linearly to ``kv_floor_score`` at 100% usage."""
    if usage is None or usage <= cfg.kv_soft:
        return 1.0
    frac = min(1.0, (usage - cfg.kv_soft) / (1.0 - cfg.kv_soft))
    return 1.0 - frac * (1.0 - cfg.kv_floor_score)


# Fewer requests (or NIXL transfers) than this in the window: too few to compare.
MIN_SAMPLES = 5


def _latency(inst: InstanceSignals) -> float | None:
    if inst.contribution_s is not None and inst.requests >= MIN_SAMPLES:
        return inst.contribution_s
    return inst.ttft_mean_s


def _handoff(inst: InstanceSignals) -> float | None:
    if inst.handoff_p50_s is not None and inst.requests >= MIN_SAMPLES:
        return inst.handoff_p50_s
    # D's queue time includes the KV pull (see vllm-pd-facts 4.5): a fallback without records.
    return inst.queue_mean_s if inst.role == "decode" else None


def _load(inst: InstanceSignals) -> float | None:
    return inst.hold_time_now_s


def _nixl(inst: InstanceSignals) -> float | None:
    return inst.nixl_xfer_mean_s if inst.nixl_transfers >= MIN_SAMPLES else None


def _ttft_now(inst: InstanceSignals) -> float | None:
    return inst.ttft_recent_s if inst.ttft_recent_count >= MIN_SAMPLES else None


def _nixl_now(inst: InstanceSignals) -> float | None:
    return inst.nixl_recent_s if inst.nixl_recent_count >= MIN_SAMPLES else None


def _error_rate(inst: InstanceSignals, window_s: float) -> float:
    rate = inst.failed_transfers_per_min
    if inst.role == "decode":
        rate += inst.lease_expiry_suspects / max(window_s / 60.0, 1e-9)
    return rate


def _values(peers: Sequence[InstanceSignals], pick: Callable[[InstanceSignals], float | None]) -> list[float]:
    out: list[float] = []
    for p in peers:
        v = pick(p)
        if v is not None:
            out.append(float(v))
    return out


def score_instance(
    inst: InstanceSignals, peers: Sequence[InstanceSignals], cfg: PolicyConfig, window_s: float
) -> tuple[Score, ...]:
    """Score one up instance against ``peers`` (the *other* up instances of its role)."""
    tol, fast = cfg.latency_tolerance, cfg.load_tolerance

    def relative(name: str, pick: Callable[[InstanceSignals], float | None], tolerance: float, note: str,
                 floor: float = NOISE_FLOOR_S) -> Score:
        value = pick(inst)
        s, ref = relative_score(value, _values(peers, pick), tolerance, floor)
        return Score(name, s, value, ref, f"{note} vs peers' median")

    scores: list[Score] = []
    if inst.role == "prefill":
        scores.append(relative("ttft", _latency, tol, "queue+prefill s"))
        scores.append(relative("ttft_now", _ttft_now, fast, "vLLM TTFT s over the last 3 scrapes"))
    hand = relative("handoff", _handoff, tol, "handoff p50 s")
    if (hand.observed is not None and hand.reference is not None and hand.observed > cfg.ttft_target_s
            and hand.reference * tol <= cfg.ttft_target_s):
        hand = replace(hand, value=0.0, note="handoff p50 s alone over the TTFT target; peers within it")
    scores.append(hand)
    what = "running+waiting" if inst.role == "prefill" else "in a KV-fetch stage"
    scores.append(relative("load", _load, fast, f"s: requests {what} ÷ finished per s,", LOAD_FLOOR_S))
    if inst.role == "decode":
        scores.append(relative("nixl", _nixl, tol, "NIXL xfer s per transfer"))
        scores.append(relative("nixl_now", _nixl_now, fast, "NIXL xfer s over the last 3 scrapes"))
    rate = _error_rate(inst, window_s)
    scores.append(
        Score("errors", error_score(rate, cfg.error_rate_ref_per_min), rate, cfg.error_rate_ref_per_min,
              "failed transfers + attributed lease expiries per min")
    )
    scores.append(Score("kv", kv_score(inst.kv_usage, cfg), inst.kv_usage, cfg.kv_soft, "KV usage"))
    return tuple(scores)


def worst(scores: Sequence[Score]) -> Score | None:
    """The lowest score under 1, or None if every signal is healthy."""
    low = min(scores, key=lambda s: s.value, default=None)
    return low if low is not None and low.value < 0.999 else None


def reason_for(score: Score, inst: InstanceSignals) -> str:
    if score.name == "errors" and inst.role == "decode" and inst.lease_expiry_suspects and (
        inst.failed_transfers_per_min == 0
    ):
        return "LeaseExpiries"
    return SIGNAL_REASONS[score.name]
