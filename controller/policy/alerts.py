"""Alert rules and their state machine: inactive -> pending -> firing -> resolved.

A rule looks at one :class:`Observation` and returns the label sets for which its
condition holds now (Prometheus' "result vector"), or ``None`` when it cannot be judged
(the collector is behind, too few requests): then every alert of that rule keeps its
state instead of resolving on missing data. An alert becomes ``pending`` when its
condition first holds, ``firing`` once it has held for the rule's ``for_s``, and
``resolved`` when it stops holding after firing (a pending alert that clears simply
goes back to ``inactive``). Thresholds come from the SLO settings and ``AlertConfig``,
which also carries the config file's per-rule ``for``, severity and on/off overrides. A
disabled rule is still listed (so the API can show it) but its condition never holds:
its alerts resolve or go inactive instead of being dropped without a trace.

The rule names are ``pdscope.config.ALERT_RULE_NAMES``; this module builds exactly those.

Pure: no I/O; ``now`` comes from the observation.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from analysis.stranded import holds_while_idle, pending_total
from analysis.tenants import TenantFigures
from controller.policy.compat import judge
from controller.policy.config import PolicyConfig
from controller.policy.signals import InstanceSignals, Observation
from pdscope.config import ALERT_RULE_NAMES, Settings, Severity

State = Literal["inactive", "pending", "firing", "resolved"]


@dataclass(frozen=True)
class Sample:
    labels: Mapping[str, str]
    value: float
    description: str


Evaluator = Callable[[Observation, PolicyConfig, "AlertConfig"], "list[Sample] | None"]
# a per-instance rule's test, judged only on fresh data (``_per_instance``)
InstanceTest = Callable[[Observation, PolicyConfig, "AlertConfig"], "list[Sample]"]


@dataclass(frozen=True)
class AlertRule:
    name: str
    severity: Severity
    for_s: float
    summary: str
    evaluate: Evaluator
    enabled: bool = True


@dataclass(frozen=True)
class AlertConfig:
    """Alert thresholds and per-rule overrides; a rule not named keeps its default.

    ``for_s`` and ``severity`` map rule names to overrides, ``disabled`` names rules that
    never fire. Unknown rule names raise ``ValueError`` (a typo would otherwise be ignored).
    """

    for_s: Mapping[str, float] = field(default_factory=dict)
    kv_full: float = 0.95
    min_requests: int = 10  # fewer completed requests in the SLO window: SLO rules abstain
    mispredicted_error: float = 0.3  # TTFTMispredicted: median |observed / predicted - 1| over this
    mispredicted_min_records: int = 50  # ... over at least this many measured predictions
    stranded_kv_usage: float = 0.0  # StrandedKV: an idle P's KV usage over this, with no D waiting to pull
    resend_s: float = 60.0  # re-notify a firing alert this often
    severity: Mapping[str, Severity] = field(default_factory=dict)
    disabled: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        unknown = sorted((set(self.for_s) | set(self.severity) | set(self.disabled)) - set(ALERT_RULE_NAMES))
        if unknown:
            raise ValueError(
                f"unknown alert rule(s) {', '.join(unknown)}; known: {', '.join(ALERT_RULE_NAMES)}"
            )

    @classmethod
    def from_settings(cls, settings: Settings) -> AlertConfig:
        """The ``alerts`` section of the validated config file as an ``AlertConfig``."""
        a = settings.alerts
        return cls(
            for_s={n: r.for_s for n, r in a.rules.items() if r.for_s is not None},
            kv_full=a.kv_full,
            min_requests=a.min_requests,
            mispredicted_error=a.mispredicted_error,
            mispredicted_min_records=a.mispredicted_min_records,
            stranded_kv_usage=a.stranded_kv_usage,
            resend_s=a.resend_s,
            severity={n: r.severity for n, r in a.rules.items() if r.severity is not None},
            disabled=frozenset(n for n, r in a.rules.items() if not r.enabled),
        )

    def for_of(self, rule: str, default: float) -> float:
        return self.for_s.get(rule, default)

    def severity_of(self, rule: str, default: Severity) -> Severity:
        return self.severity.get(rule, default)


@dataclass(frozen=True)
class AlertState:
    rule: str
    fingerprint: str
    labels: Mapping[str, str]
    severity: str
    state: State
    value: float
    description: str
    summary: str
    active_since: float
    last_eval: float
    fired_at: float | None = None
    resolved_at: float | None = None
    last_notified: float | None = None


@dataclass(frozen=True)
class AlertStep:
    """One evaluation: the alerts still active, every state change, and what to notify."""

    active: tuple[AlertState, ...]
    changed: tuple[AlertState, ...]
    notify: tuple[AlertState, ...]


def fingerprint(rule: str, labels: Mapping[str, str]) -> str:
    raw = json.dumps({"alertname": rule, **labels}, sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _stale(obs: Observation, cfg: PolicyConfig) -> bool:
    age = obs.data_age_s
    return age is None or age > cfg.stale_after_s


# -- rules --------------------------------------------------------------------------------


def _fleet(
    value: float | None, judged: bool, within: Callable[[float], bool], describe: Callable[[float], str]
) -> list[Sample] | None:
    """A fleet-wide rule on one figure: None (every alert keeps its state) when it cannot be judged
    (not ``judged``, or no ``value``), no sample while ``value`` is ``within`` its bound, else the one
    sample that ``describe`` words."""
    if not judged or value is None:
        return None
    return [] if within(value) else [Sample({}, value, describe(value))]


def _latency(
    name: str, value: float | None, target: float, percentile: float, obs: Observation, ac: AlertConfig
) -> list[Sample] | None:
    """A latency percentile (``name``: TTFT, TPOT) over its SLO ``target``, judged on enough requests."""
    s = obs.slo
    return _fleet(
        value,
        s.completed >= ac.min_requests,
        lambda v: v <= target,
        lambda v: (
            f"{name} p{percentile:g} {v * 1000:.0f} ms > target {target * 1000:.0f} ms over {s.window_s:.0f}s"
        ),
    )


def _ttft(obs: Observation, cfg: PolicyConfig, ac: AlertConfig) -> list[Sample] | None:
    return _latency("TTFT", obs.slo.ttft_at_slo_s, cfg.ttft_target_s, cfg.ttft_percentile, obs, ac)


def _tpot(obs: Observation, cfg: PolicyConfig, ac: AlertConfig) -> list[Sample] | None:
    return _latency("TPOT", obs.slo.tpot_at_slo_s, cfg.tpot_target_s, cfg.tpot_percentile, obs, ac)


def _goodput(obs: Observation, cfg: PolicyConfig, ac: AlertConfig) -> list[Sample] | None:
    s = obs.slo
    return _fleet(
        s.attainment,
        s.completed >= ac.min_requests,
        lambda att: att >= cfg.goodput_attainment,
        lambda att: (
            f"SLO attainment {100 * att:.1f}% < {100 * cfg.goodput_attainment:.0f}% "
            f"({s.met}/{s.completed} requests met every SLO over {s.window_s:.0f}s)"
        ),
    )


def _handoff(obs: Observation, cfg: PolicyConfig, ac: AlertConfig) -> list[Sample] | None:
    budget = cfg.handoff_budget_s
    return _fleet(
        obs.slo.handoff_p99_s,
        not _stale(obs, cfg),
        lambda p99: p99 <= budget,
        lambda p99: f"handoff p99 {p99 * 1000:.0f} ms > budget {budget * 1000:.0f} ms",
    )


def _per_instance(test: InstanceTest) -> Evaluator:
    def evaluate(obs: Observation, cfg: PolicyConfig, ac: AlertConfig) -> list[Sample] | None:
        return None if _stale(obs, cfg) else test(obs, cfg, ac)

    return evaluate


def _labels(name: str, pool: str, role: str) -> dict[str, str]:
    return {"instance": name, "pool": pool, "role": role}


def _per_minute(read: Callable[[InstanceSignals], float], what: str) -> InstanceTest:
    """A per-instance rate per minute that holds while above zero: ``what`` names it in the text."""

    def test(obs: Observation, cfg: PolicyConfig, ac: AlertConfig) -> list[Sample]:
        return [
            Sample(_labels(i.name, i.pool, i.role), rate, f"{i.name}: {rate:.1f} {what}")
            for i in obs.instances
            if (rate := read(i)) > 0
        ]

    return test


_failed = _per_minute(lambda i: i.failed_transfers_per_min, "failed NIXL transfers per minute")
_expired = _per_minute(
    lambda i: i.expired_leases_per_min, "KV leases expired per minute (D did not pull in time)"
)


def _kv_full(obs: Observation, cfg: PolicyConfig, ac: AlertConfig) -> list[Sample]:
    return [
        Sample(
            _labels(i.name, i.pool, i.role), i.kv_usage, f"{i.name}: KV cache {100 * i.kv_usage:.0f}% used"
        )
        for i in obs.instances
        if i.up and i.kv_usage is not None and i.kv_usage > ac.kv_full
    ]


def _stranded_kv(obs: Observation, cfg: PolicyConfig, ac: AlertConfig) -> list[Sample]:
    """A P that holds KV blocks while idle (nothing running or waiting) and no D waits to pull from anyone:
    the blocks wait on leases no D will pull, so they hold until the lease reaper frees them (it should
    within ``kv_lease_duration``; this rule's ``for`` is longer). Abstains while any up D's KV-fetch gauges
    are missing (a D that cannot be seen might be waiting)."""
    pending = pending_total(i.pulls_pending for i in obs.instances if i.role == "decode" and i.up)
    if pending is None or pending > 0:
        return []
    return [
        Sample(_labels(i.name, i.pool, i.role), i.kv_usage or 0.0, _stranded_text(i))
        for i in obs.instances
        if i.role == "prefill"
        and holds_while_idle(i.up, i.kv_usage, i.num_running, i.num_waiting, ac.stranded_kv_usage)
    ]


def _stranded_text(i: InstanceSignals) -> str:
    usage = i.kv_usage or 0.0
    head = f"{i.name}: {100 * usage:.1f}% of its KV blocks held while idle, and no D waits to pull"
    if not i.unpulled_handoffs:
        return f"{head}; no handoff it prefilled in the window went unserved"
    names = ", ".join(i.unpulled_ids)
    return f"{head}; {i.unpulled_handoffs} handoff(s) it prefilled in the window went unserved (e.g. {names})"


def _incompatible(obs: Observation, cfg: PolicyConfig, ac: AlertConfig) -> list[Sample]:
    """An instance compatible with no instance of the other role (model, KV layout, revision:
    :mod:`controller.policy.compat`); one with nothing on record yet abstains."""
    found = judge(obs, {}).no_partner or {}
    return [
        Sample(_labels(i.name, i.pool, i.role), 1.0, found[i.name]) for i in obs.instances if i.name in found
    ]


def _down(obs: Observation, cfg: PolicyConfig, ac: AlertConfig) -> list[Sample]:
    return [
        Sample(_labels(i.name, i.pool, i.role), 0.0, f"{i.name}: scrape failed (up = 0)")
        for i in obs.instances
        if i.up is False
    ]


def _collector_behind(obs: Observation, cfg: PolicyConfig, ac: AlertConfig) -> list[Sample] | None:
    age = obs.data_age_s
    if age is None:
        return [Sample({}, -1.0, "no snapshots in the store at all")]
    if age > cfg.stale_after_s:
        return [Sample({}, age, f"newest snapshot is {age:.0f}s old (limit {cfg.stale_after_s:.0f}s)")]
    return []


def _mispredicted(obs: Observation, cfg: PolicyConfig, ac: AlertConfig) -> list[Sample] | None:
    """The proxy's TTFT predictions are off: the fleet changed under the predictor."""
    s = obs.slo
    limit = ac.mispredicted_error
    return _fleet(
        s.prediction_error_p50,
        s.predictions >= ac.mispredicted_min_records,
        lambda err: err <= limit,
        lambda err: (
            f"TTFT predictions off by a median {100 * err:.0f}% > {100 * limit:.0f}% "
            f"(|observed/predicted - 1| over {s.predictions} requests in {s.window_s:.0f}s)"
        ),
    )


def _tenant_breach(obs: Observation, cfg: PolicyConfig, ac: AlertConfig) -> list[Sample]:
    """A tenant with at least ``min_requests`` served in the window whose share meeting *its own* targets
    (``tenants.<id>.slo``, else the fleet's) is under ``slo.goodput_attainment``. No tenants (off): none."""
    window = obs.tenants
    if window is None:
        return []
    return [
        Sample(
            {"tenant": t.tenant},
            att,
            _breach_text(t, att, cfg.goodput_attainment, window.until - window.since),
        )
        for t in window.tenants
        if t.served >= ac.min_requests and (att := t.attainment) is not None and att < cfg.goodput_attainment
    ]


def _breach_text(t: TenantFigures, att: float, target: float, span_s: float) -> str:
    return (
        f"tenant {t.tenant}: SLO attainment {100 * att:.1f}% < {100 * target:.0f}% against its targets "
        f"(TTFT {t.ttft_target_s * 1000:.0f} ms, TPOT {t.tpot_target_s * 1000:.0f} ms): "
        f"{t.met}/{t.served} served requests met them over {span_s:.0f}s"
    )


def _tenant_starved(obs: Observation, cfg: PolicyConfig, ac: AlertConfig) -> list[Sample]:
    """A tenant that asked (at least ``min_requests`` in the window, refused or kept waiting) and was served
    nothing. No tenants (off): none."""
    window = obs.tenants
    if window is None:
        return []
    return [
        Sample({"tenant": t.tenant}, float(t.demand), _starved_text(t, window.until - window.since))
        for t in window.tenants
        if t.starved and t.demand >= ac.min_requests
    ]


def _starved_text(t: TenantFigures, span_s: float) -> str:
    reasons = ", ".join(f"{n} {r}" for r, n in sorted(t.rejected.items(), key=lambda kv: -kv[1]))
    refused = f"{t.rejected_total} rejected ({reasons})" if t.rejected else "none rejected"
    return (
        f"tenant {t.tenant}: {t.demand} requests over {span_s:.0f}s and none served: {refused}, "
        f"{t.failed} failed (error or timeout)"
    )


def default_rules(ac: AlertConfig) -> tuple[AlertRule, ...]:
    """Every built-in rule, in ``ALERT_RULE_NAMES`` order, with ``ac``'s overrides applied.

    Disabled rules are included with ``enabled=False``; :func:`step_alerts` treats them
    as never holding.
    """
    spec: Sequence[tuple[str, Severity, float, str, Evaluator]] = (
        ("TTFTOverTarget", "warning", 60.0, "TTFT percentile over its SLO target", _ttft),
        ("TPOTOverTarget", "warning", 60.0, "TPOT percentile over its SLO target", _tpot),
        ("GoodputAttainmentLow", "critical", 60.0, "SLO attainment under target", _goodput),
        ("NixlTransferFailures", "warning", 0.0, "NIXL KV transfers are failing", _per_instance(_failed)),
        ("KVLeaseExpired", "warning", 0.0, "KV leases expired before D pulled them", _per_instance(_expired)),
        ("KVCacheNearlyFull", "warning", 30.0, "KV usage above the limit", _per_instance(_kv_full)),
        ("InstanceDown", "critical", 10.0, "an instance's /metrics cannot be scraped", _per_instance(_down)),
        (
            "StrandedKV",
            "warning",
            60.0,
            "an idle P holds KV blocks that no D waits to pull",
            _per_instance(_stranded_kv),
        ),
        (
            "IncompatiblePair",
            "warning",
            60.0,
            "an instance is compatible with no instance of the other role: left unrouted",
            _per_instance(_incompatible),
        ),
        ("HandoffP99OverBudget", "warning", 30.0, "P->D handoff p99 over its budget", _handoff),
        (
            "CollectorBehind",
            "critical",
            10.0,
            "stored data is stale: the collector is behind",
            _collector_behind,
        ),
        ("TTFTMispredicted", "warning", 60.0, "the TTFT predictor is off: the fleet changed", _mispredicted),
        ("TenantSLOBreach", "warning", 60.0, "a tenant's SLO attainment under target", _tenant_breach),
        ("TenantStarved", "critical", 30.0, "a tenant asks and is served nothing", _tenant_starved),
    )
    return tuple(
        AlertRule(n, ac.severity_of(n, sev), ac.for_of(n, f), summ, ev, enabled=n not in ac.disabled)
        for n, sev, f, summ, ev in spec
    )


# -- state machine ------------------------------------------------------------------------


def step_alerts(
    rules: Sequence[AlertRule],
    obs: Observation,
    cfg: PolicyConfig,
    ac: AlertConfig,
    prev: Mapping[str, AlertState],
) -> AlertStep:
    """Advance every alert by one evaluation at ``obs.now``. ``prev`` maps fingerprint -> state."""
    now = obs.now
    active: list[AlertState] = []
    changed: list[AlertState] = []
    notify: list[AlertState] = []
    for rule in rules:
        mine = {fp: st for fp, st in prev.items() if st.rule == rule.name}
        samples = rule.evaluate(obs, cfg, ac) if rule.enabled else []
        if samples is None:  # cannot judge: hold, but record the evaluation time
            active.extend(replace(st, last_eval=now) for st in mine.values())
            continue
        seen: set[str] = set()
        for sm in samples:
            fp = fingerprint(rule.name, sm.labels)
            seen.add(fp)
            old = mine.get(fp)
            if old is None:
                st = AlertState(
                    rule.name,
                    fp,
                    dict(sm.labels),
                    rule.severity,
                    "pending",
                    sm.value,
                    sm.description,
                    rule.summary,
                    active_since=now,
                    last_eval=now,
                )
                changed.append(st)
            else:
                st = replace(
                    old, severity=rule.severity, value=sm.value, description=sm.description, last_eval=now
                )
            if st.state == "pending" and now - st.active_since >= rule.for_s:
                st = replace(st, state="firing", fired_at=now)
                if old is not None:
                    changed.append(st)
                else:
                    changed[-1] = st
            if st.state == "firing" and (st.last_notified is None or now - st.last_notified >= ac.resend_s):
                st = replace(st, last_notified=now)
                notify.append(st)
            active.append(st)
        for fp, old in mine.items():
            if fp in seen:
                continue
            if old.state == "firing":
                gone = replace(old, state="resolved", resolved_at=now, last_eval=now, last_notified=now)
                changed.append(gone)
                notify.append(gone)
            else:
                changed.append(replace(old, state="inactive", last_eval=now))
    return AlertStep(tuple(active), tuple(changed), tuple(notify))
