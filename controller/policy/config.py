"""The policy's knobs: one frozen value, built once from the validated settings.

Guardrails (``max_weight_step``, ``min_weight``) and SLO targets come from the config
file; the remaining constants are defaults chosen here and documented next to each
field. Nothing here reads files or the environment.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdscope.config import Settings


@dataclass(frozen=True)
class PolicyConfig:
    interval_s: float = 2.0
    max_weight_step: float = 0.25  # most a weight may move in one tick
    # Floor for an up, undrained instance: a trickle, not a sample. At any floor a bad instance gets
    # too few requests to show it is well again, so recovery is probed (probe_after_s), and every
    # request the floor sends to a bad instance misses its SLO: keep it small.
    min_weight: float = 0.02
    smoothing: float = 0.5  # EWMA factor on the target: s = a*target + (1-a)*s_prev
    band_down: float = 0.05  # smoothed must sit this far below the weight to lower it
    band_up: float = 0.10  # ... and this far above it to raise it
    recover_ticks: int = 3  # consecutive healthy ticks before a weight may rise
    probe_after_s: float = 30.0  # with too few requests to judge, a lowered weight may rise after this long
    probe_weight: float = 0.1  # ... but only to this (a probe); higher needs evidence
    probe_hold_s: float = 20.0  # a probe's first failures within this long cut it back to the floor at once
    probe_min_requests: int = 3  # requests (or transfers) that judge a probe (at or under probe_weight)
    # significance: what a cut needs to be evidence, not noise
    min_samples: int = 5  # requests or NIXL transfers in the window before a latency score may cut
    noise_z: float = 2.0  # each tolerance gets a margin of z relative standard errors (own and peers')
    startup_s: float = 60.0  # no latency/load/limit cuts until the store has watched the fleet this long
    min_error_events: int = 3  # failures or attributed expiries in the window before they score
    failure_ref_fraction: float = 0.05  # own failed requests: this share (its lower bound) halves the score
    queue_confirm_ticks: int = 2  # ticks in a row a P-queue pressure must hold before a limit cut
    degrade_ticks: int = 2  # consecutive degraded ticks before a mild degradation lowers a weight
    severe_target: float = 0.5  # a target under this lowers the weight on the first tick
    latency_tolerance: float = 1.5  # slower than 1.5x the peers' median costs weight
    load_tolerance: float = 2.0  # more than 2x the peers' in-flight work per unit weight costs weight
    error_rate_ref_per_min: float = 1.0  # failures+expiries per minute that halve the error score
    kv_soft: float = 0.85  # KV usage above which the kv score falls ...
    kv_floor_score: float = 0.2  # ... to this at 100%
    stale_after_s: float = 15.0  # newest snapshot older than this: hold everything
    down_after_s: float = 10.0  # failed scrapes for this long before an instance counts as down
    # admission
    ttft_target_s: float = 2.0
    ttft_percentile: float = 99.0
    tpot_target_s: float = 0.1
    tpot_percentile: float = 99.0
    goodput_attainment: float = 0.9
    handoff_budget_s: float = 1.0  # handoff p99 budget (default: half the TTFT target)
    kv_admit_full: float = 0.80  # D pool KV usage at which admission starts to shrink ...
    kv_admit_zero: float = 0.95  # ... reaching the floor here
    default_max_inflight_requests: int = 256
    default_max_inflight_kv_bytes: int = 64 * 2**30
    min_inflight_requests: int = 4
    default_queue_wait_s: float = 1.0  # the proxy's queue timeout: the most the wait budget may be
    cut_below: float = 0.8  # pressure under this cuts the request limit ...
    grow_above: float = 0.95  # ... over this grows it; in between it holds
    min_kv_bytes_fraction: float = 0.05  # never cut the KV-bytes budget below this share
    limit_cut_floor: float = 0.5  # one cut takes at most half away
    limit_increase: float = 0.1  # additive increase: +10% (at least +1) per calm tick
    limit_cut_cooldown_ticks: int = 3  # wait for a cut to show in the window before cutting again

    @classmethod
    def from_settings(cls, settings: Settings) -> PolicyConfig:
        c = settings.controller
        a = settings.proxy.admission
        ttft_s = settings.slo.ttft.target_ms / 1000.0
        return cls(
            interval_s=c.interval_s,
            max_weight_step=c.max_weight_step,
            min_weight=c.min_weight,
            probe_after_s=c.probe.after_s,
            probe_weight=max(c.probe.weight, c.min_weight),
            probe_hold_s=c.probe.hold_s,
            min_samples=c.noise.min_samples,
            noise_z=c.noise.z,
            startup_s=c.noise.startup_s if c.noise.startup_s is not None else 2.0 * c.window_s,
            min_error_events=c.noise.min_error_events,
            queue_confirm_ticks=c.noise.queue_confirm_ticks,
            stale_after_s=max(15.0, 3.0 * settings.collector.scrape_interval_s, 3.0 * c.interval_s),
            down_after_s=min(c.window_s, max(10.0, 3.0 * settings.collector.scrape_interval_s)),
            ttft_target_s=ttft_s,
            ttft_percentile=settings.slo.ttft.percentile,
            tpot_target_s=settings.slo.tpot.target_ms / 1000.0,
            tpot_percentile=settings.slo.tpot.percentile,
            goodput_attainment=settings.slo.goodput_attainment,
            handoff_budget_s=(settings.slo.handoff_budget_ms / 1000.0 if settings.slo.handoff_budget_ms is not None
                              else ttft_s / 2.0),
            default_max_inflight_requests=a.max_inflight_requests,
            default_max_inflight_kv_bytes=a.max_inflight_kv_bytes,
            default_queue_wait_s=a.queue_timeout_s,
        )
