"""The policy's knobs: one frozen value, built once from the validated settings.

Two kinds of field. Those the config file sets (guardrails such as ``max_weight_step`` and
``min_weight``, the SLO targets, the admission defaults, the noise settings) have no default
here: :meth:`PolicyConfig.from_settings` derives them from ``Settings``, and
:meth:`PolicyConfig.defaults` from the config models' own defaults, so a default lives in one
place (``pdscope/config.py``). The rest are the policy's constants, chosen here and documented
next to each field. Every decision records the config it was taken under
(:meth:`PolicyConfig.fingerprint`, with :data:`POLICY_VERSION`).

:class:`EvidenceConfig` is what the evidence step reads (how a window's records become the
observation: ``controller/observe.py`` and ``controller/policy/evidence.py``). Its fields that act
there only (:data:`EVIDENCE_ONLY`) cannot act in a replay or a shadow, which decide on the
recorded observation: :func:`decision_setting_value` refuses them. A ``PolicyConfig`` carries them
too (:attr:`PolicyConfig.evidence`), so the stored record of a config, and its fingerprint, name
everything a decision was taken under.

Nothing here reads files or the environment.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Final

from pdscope.config import AdmissionDefaults, ControllerSettings, ProxySettings, Settings, SLOSettings

# Bumped whenever the policy's maths change what a decision would be for the same inputs and
# config: a stored decision names the version that took it (a replay under another refuses).
POLICY_VERSION = (
    10  # 4: the handoff judged by the P×D matrix, failures moved along a P's row (issue 29); 5: a
)
# pool's members that are down or cut shed load onto the others, not cut for it (issue 29); 6: failures
# every peer counts too are the pool's, not one member's; an instance unreachable twice is down; a P×D cell
# read over its recent handoffs too; a P's row failures spread as its handoffs; speed under carried load
# (issue 29); 7: a P cut on its handoff side is raised on its handoffs, not its prefill requests; 8: a
# line needs two cells where the fleet's other side has two instances; a line far past its window is read
# over half as many recent handoffs; 9: a pair into a restarted P that fails and serves nothing is left out
# of routing and its failures (and a D's while a P is down or freshly restarted) are not the D's (issue 30);
# 10: a pair whose P and D differ in model, KV layout or revision (or where one is unknown and a side has a
# compatible partner) is left out of routing (IncompatiblePair)


@dataclass(frozen=True)
class EvidenceConfig:
    """The evidence step's knobs: what a window's aggregate needs before it says something."""

    recent_s: float  # "the last three scrapes": the span of the fast signals
    kv_lease_s: float  # how long P holds a request's KV blocks for D (lease expiries are looked for back)
    ttft_percentile: float  # the SLO's TTFT percentile (the policy's too)
    pair_min_samples: int = 10  # a P x D pair's TTFT percentile needs this many requests in the window
    pool_min_requests: int = 20  # a pool's completion rate (and so its backlog in seconds) needs this many
    min_rate_span_s: float = 2.0  # rates over the span the records cover are never over a shorter one
    # the window's first record later than this share of it into the window: rates over the covered span
    coverage_start_fraction: float = 0.25
    lease_lookback: float = 4.0  # an expired lease is counted a lease after its request: look this many back
    # a P x D cell is read over the handoffs that finished in these last seconds too (PairSignals.recent_*):
    # a window's median of a link that just slowed waits for half its samples to be slow
    handoff_recent_s: float = 5.0
    # the fleet's KV handoff mode (pools' handoff): in push mode vLLM records the transfers on P, so a D's
    # finished handoffs are its first tokens, not its NIXL transfers
    handoff: str = "pull"


# The evidence step's fields that no decision reads: changed in a replay or a shadow (which decide on
# the recorded observation) they could not act.
EVIDENCE_ONLY: Final = frozenset(f.name for f in dataclasses.fields(EvidenceConfig)) - {"ttft_percentile"}


@dataclass(frozen=True)
class PolicyConfig:
    # -- from the config file (no defaults here: see from_settings / defaults)
    interval_s: float
    window_s: float
    max_weight_step: float  # most a weight may move in one tick
    # Floor for an up, undrained instance: a trickle, not a sample. At any floor a bad instance gets
    # too few requests to show it is well again, so recovery is probed (probe_after_s), and every
    # request the floor sends to a bad instance misses its SLO: keep it small.
    min_weight: float
    probe_after_s: float  # with too few requests to judge, a lowered weight may rise after this long
    probe_weight: float  # ... but only to this (a probe); higher needs evidence
    probe_hold_s: float  # a probe's first failures within this long cut it back to the floor at once
    # significance: what a cut needs to be evidence, not noise
    min_samples: int  # requests or NIXL transfers in the window before a latency score may cut
    noise_z: float  # each tolerance gets a margin of z relative standard errors (own and peers')
    startup_s: float  # no latency/load/limit cuts until the store has watched the fleet this long
    min_error_events: int  # failures or attributed expiries in the window before they score
    queue_confirm_ticks: int  # ticks in a row a P-queue pressure must hold before a limit cut
    stale_after_s: float  # newest snapshot older than this: hold everything
    down_after_s: float  # failed scrapes for this long before an instance counts as down
    recent_s: float  # EvidenceConfig's
    kv_lease_s: float  # EvidenceConfig's
    ttft_target_s: float
    ttft_percentile: float
    tpot_target_s: float
    tpot_percentile: float
    goodput_attainment: float
    handoff_budget_s: float  # handoff p99 budget (default: half the TTFT target)
    default_max_inflight_requests: int
    default_max_inflight_kv_bytes: int
    default_queue_wait_s: float  # the proxy's queue timeout: the most the wait budget may be
    # pdscope's proxies admit by prediction (proxy.predict.admit, weighted policy): TTFT and P's queue are
    # theirs to act on, the pool limits a ceiling for what they cannot see (policy.admission)
    proxies_predict: bool
    # -- the policy's constants
    smoothing: float = 0.5  # EWMA factor on the target: s = a*target + (1-a)*s_prev
    snap: float = 0.01  # a smoothed value this close to its target is the target (an EWMA never arrives)
    band_down: float = 0.05  # smoothed must sit this far below the weight to lower it
    band_up: float = 0.10  # ... and this far above it to raise it
    recover_ticks: int = 3  # consecutive healthy ticks before a weight may rise
    # scrapes in a row that could not connect (refused, no route) before an instance is down without
    # waiting down_after_s: nothing listens there (a timeout may be a busy instance, and waits)
    down_after_unreachable: int = 2
    probe_min_requests: int = 3  # requests (or transfers) that judge a probe (at or under probe_weight)
    min_recent_samples: int = 5  # the fast signals need this many samples over the last three scrapes
    failure_ref_fraction: float = 0.05  # own failed requests: this share (its lower bound) halves the score
    degrade_ticks: int = 2  # consecutive degraded ticks before a mild degradation lowers a weight
    severe_target: float = 0.5  # a target under this lowers the weight on the first tick
    # a fast signal's score under this (over 3x the tolerance past its peers: a stuck instance) acts on
    # the first tick; above it a fast reading waits for a second
    extreme_score: float = 1 / 3
    latency_tolerance: float = 1.5  # slower than 1.5x the peers' median costs weight
    # the P×D handoff matrix (analysis.blame) blames a P's row, a D's column or a pair from this ratio over
    # the typical pair: past what a healthy fleet's noise reaches (its tests), so a judged handoff cuts
    # only the side that is slow
    blame_threshold: float = 2.0
    load_tolerance: float = 2.0  # more than 2x the peers' in-flight work per unit weight costs weight
    noise_floor_s: float = 0.005  # latency differences under this are noise, not a signal
    # differences in the time a request spends at an instance now under this are noise: a ratio of small
    # counts over three scrapes (3 held / 5 finished in 3 s is 1.8 s)
    load_floor_s: float = 1.0
    error_rate_ref_per_min: float = 1.0  # failures+expiries per minute that halve the error score
    kv_soft: float = 0.85  # KV usage above which the kv score falls ...
    kv_floor_score: float = 0.2  # ... to this at 100%
    # the observation: how much evidence a window's aggregate needs (EvidenceConfig's, with its defaults)
    pair_min_samples: int = EvidenceConfig.pair_min_samples
    pool_min_requests: int = EvidenceConfig.pool_min_requests
    min_rate_span_s: float = EvidenceConfig.min_rate_span_s
    coverage_start_fraction: float = EvidenceConfig.coverage_start_fraction
    lease_lookback: float = EvidenceConfig.lease_lookback
    handoff_recent_s: float = EvidenceConfig.handoff_recent_s
    handoff: str = EvidenceConfig.handoff
    # admission
    kv_admit_full: float = 0.80  # D pool KV usage at which admission starts to shrink ...
    kv_admit_zero: float = 0.95  # ... reaching the floor here
    min_inflight_requests: int = 4
    cut_below: float = 0.8  # pressure under this cuts the request limit ...
    grow_above: float = 0.95  # ... over this grows it; in between it holds
    min_kv_bytes_fraction: float = 0.05  # never cut the KV-bytes budget below this share
    limit_cut_floor: float = 0.5  # one cut takes at most half away
    # additive increase: +30% (at least +1) per recover_ticks calm ticks (one decision, not one per tick)
    limit_increase: float = 0.3
    limit_cut_cooldown_ticks: int = 3  # wait for a cut to show in the window before cutting again
    queue_budget_floor: float = 0.1  # the queue factor's budget is never less than this share of the target
    wait_step_s: float = 0.05  # the wait budget is measured in steps of this
    # ... and published only when the measure moved by this share of the TTFT target or more ...
    wait_band: float = 0.15
    # ... on every tick for this many windows, plus one tick: one slow request holds the window's
    # percentile for exactly a window, so a dip that outlasts it is more than one request
    wait_confirm_windows: float = 1.0

    @classmethod
    def from_settings(cls, settings: Settings) -> PolicyConfig:
        cfg = cls._derive(
            settings.controller,
            settings.slo,
            settings.proxy.admission,
            settings.collector.scrape_interval_s,
            _predicts(settings.proxy),
        )
        return dataclasses.replace(cfg, handoff=settings.handoff)

    @classmethod
    def defaults(cls, **changes: Any) -> PolicyConfig:
        """The config a default ``pdscope.yaml`` gives, with ``changes`` (tests and tools)."""
        scrape = _default_of("collector", "scrape_interval_s")
        proxy = ProxySettings()
        cfg = cls._derive(
            ControllerSettings(), SLOSettings(), proxy.admission, float(scrape), _predicts(proxy)
        )
        return dataclasses.replace(cfg, **changes)

    @classmethod
    def _derive(
        cls,
        c: ControllerSettings,
        slo: SLOSettings,
        a: AdmissionDefaults,
        scrape_interval_s: float,
        predicts: bool,
    ) -> PolicyConfig:
        ttft_s = slo.ttft.target_ms / 1000.0
        return cls(
            interval_s=c.interval_s,
            window_s=c.window_s,
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
            stale_after_s=max(15.0, 3.0 * scrape_interval_s, 3.0 * c.interval_s),
            down_after_s=min(c.window_s, max(10.0, 3.0 * scrape_interval_s)),
            recent_s=max(3.0, 3.0 * scrape_interval_s),
            kv_lease_s=c.kv_lease_s,
            ttft_target_s=ttft_s,
            ttft_percentile=slo.ttft.percentile,
            tpot_target_s=slo.tpot.target_ms / 1000.0,
            tpot_percentile=slo.tpot.percentile,
            goodput_attainment=slo.goodput_attainment,
            handoff_budget_s=(
                slo.handoff_budget_ms / 1000.0 if slo.handoff_budget_ms is not None else ttft_s / 2.0
            ),
            default_max_inflight_requests=a.max_inflight_requests,
            default_max_inflight_kv_bytes=a.max_inflight_kv_bytes,
            default_queue_wait_s=a.queue_timeout_s,
            proxies_predict=predicts,
        )

    @property
    def wait_confirm_ticks(self) -> int:
        """Ticks in a row a measured wait budget past the dead band must hold before it is published."""
        return math.ceil(self.wait_confirm_windows * self.window_s / self.interval_s) + 1

    @property
    def evidence(self) -> EvidenceConfig:
        """The evidence step's part of this config."""
        return EvidenceConfig(**{name: getattr(self, name) for name in _EVIDENCE_FIELDS})

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """``v<POLICY_VERSION>:<hash>``: names the policy version and every value of this config."""
        blob = json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))
        return f"v{POLICY_VERSION}:{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


_FIELDS = {f.name: f for f in dataclasses.fields(PolicyConfig)}
_EVIDENCE_FIELDS = tuple(f.name for f in dataclasses.fields(EvidenceConfig))


def setting_value(name: str, raw: object) -> float | int:
    """``raw`` (text or a number) as the value of policy setting ``name`` (a :class:`PolicyConfig`
    field, e.g. ``min_weight``): a finite number at least 0, an integer for an integer field.
    Raises ``ValueError("<name>: why")``; a name that is not a setting says the nearest ones."""
    f = _FIELDS.get(name)
    if f is None:
        near = difflib.get_close_matches(name, list(_FIELDS), n=3, cutoff=0.6)
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise ValueError(f"{name[:60]}: not a policy setting{hint}; see docs/policy.md")
    integer = str(f.type) == "int"
    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
        raise ValueError(f"{name}: expected a number, got {type(raw).__name__}")
    try:
        value: float | int = int(raw) if integer else float(raw)
    except ValueError:
        raise ValueError(
            f"{name}: {str(raw)[:40]!r} is not {'an integer' if integer else 'a number'}"
        ) from None
    if integer and isinstance(raw, float) and raw != value:
        raise ValueError(f"{name}: {raw!r} is not an integer")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}: must be a finite number at least 0, not {str(raw)[:40]!r}")
    return value


def decision_setting_value(name: str, raw: object) -> float | int:
    """:func:`setting_value` for a replay or a shadow, which decide on the recorded observation:
    an :data:`EVIDENCE_ONLY` field could not act there, and raises ``ValueError("<name>: why")``."""
    if name in EVIDENCE_ONLY:
        raise ValueError(
            f"{name}: acts only in the evidence step (how a window's records become the observation); "
            "a replay or a shadow decides on the recorded observation, so it cannot act here "
            "(pdscope whatif re-runs the evidence)"
        )
    return setting_value(name, raw)


def _predicts(proxy: ProxySettings) -> bool:
    """pdscope's proxies admit by prediction (as ``proxy.gate.Gate.by_prediction`` decides)."""
    return proxy.predict.admit and proxy.policy == "weighted"


def _default_of(section: str, name: str) -> Any:
    """A field's default in the config models (``Settings.<section>.<name>``)."""
    model = Settings.model_fields[section].annotation
    assert isinstance(model, type)
    return model.model_fields[name].default
