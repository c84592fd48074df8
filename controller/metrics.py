"""The controller's own Prometheus metrics, read from the reconciler at scrape time.

A custom collector on a per-app registry (no global registry): every scrape reports the
current values, so an alert that resolved or an instance that left leaves no stale
series behind. Alerts are exported the way Prometheus exports its own,
``pdscope_alerts{alertname, alertstate, severity, ...labels} 1``, by the leader only (a standby
evaluates no rule), so two replicas never double an alert's series.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import cached_property
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from analysis.tenants import TenantFigures
from controller.leader import mode_warning
from controller.loop import Reconciler
from controller.notify import Notifier
from controller.policy.alerts import AlertState
from controller.policy.routes import ServedInstance
from controller.policy.signals import SLOFigures
from controller.proxies import CLAIMS, OUTCOMES, ProxyRegistry
from controller.regret import FlapTally
from pdscope.metricfamilies import Family, Sample, Samples, families, one
from pdscope.routing import InstanceRoute, PoolRoute


class _Scrape:
    """One scrape's reads of the reconciler: its view once, the shadow's status once."""

    def __init__(self, reconciler: Reconciler, notifier: Notifier) -> None:
        self.reconciler = reconciler
        self.notifier = notifier
        self.v = reconciler.view()

    @cached_property
    def shadow(self) -> dict[str, Any] | None:
        """The shadow policy's status (``controller.shadow``); None without a shadow."""
        return self.reconciler.shadow_status()

    @cached_property
    def served(self) -> list[tuple[str, InstanceRoute, ServedInstance]]:
        """The served instances that are in the table, with their route."""
        by_name = {r.name: r for r in self.v.table.instances}
        return [(name, by_name[name], s) for name, s in self.v.served.items() if name in by_name]

    @cached_property
    def active(self) -> tuple[AlertState, ...]:
        return tuple(self.v.last.alerts.active) if self.v.last is not None else ()

    @cached_property
    def alert_keys(self) -> list[str]:
        """The alerts' own label names, after the fixed three."""
        return sorted({k for a in self.active for k in a.labels})


def _shadow(read: Callable[[dict[str, Any]], float]) -> Callable[[_Scrape], Samples]:
    """A figure of the shadow policy's, absent without a shadow."""
    return lambda s: None if s.shadow is None else one(read(s.shadow))


def _shadow_weights(s: _Scrape) -> Samples:
    if s.shadow is None:
        return None
    return [((name,), pair["shadow"]) for name, pair in s.shadow["weights"].items()]


def _pool_limit(read: Callable[[PoolRoute], float | None]) -> Callable[[_Scrape], Samples]:
    """An admission limit per pool: the pools that have one."""
    return lambda s: [((p.name, p.role), v) for p in s.v.table.pools if (v := read(p)) is not None]


def _mode_mismatch(s: _Scrape) -> list[Sample]:
    return one(0.0 if mode_warning(s.v.role, s.reconciler.mode, s.v.leader) is None else 1.0)


def _alerts(s: _Scrape) -> list[Sample]:
    return [
        ((a.rule, a.state, a.severity, *(a.labels.get(k, "") for k in s.alert_keys)), 1.0) for a in s.active
    ]


def _firing(s: _Scrape) -> list[Sample]:
    counts = Counter(a.rule for a in s.active if a.state == "firing")
    return [((rule.name,), counts.get(rule.name, 0)) for rule in s.reconciler.rules]


def _observed(read: Callable[[SLOFigures], float | None]) -> Callable[[_Scrape], Samples]:
    """An SLO figure of the last observation (absent before one; no sample while it is None)."""
    return lambda s: None if s.v.obs is None else [((), v) for v in (read(s.v.obs.slo),) if v is not None]


def _per_tenant(read: Callable[[TenantFigures], float | None]) -> Callable[[_Scrape], Samples]:
    """A figure of each declared tenant over the last observation (label values from the config only);
    absent while tenants are off or before an observation, no sample while it is None."""

    def samples(s: _Scrape) -> Samples:
        window = s.v.obs.tenants if s.v.obs is not None else None
        if window is None:
            return None
        return [((t.tenant,), v) for t in window.tenants if (v := read(t)) is not None]

    return samples


def _jain(s: _Scrape) -> Samples:
    window = s.v.obs.tenants if s.v.obs is not None else None
    return None if window is None or window.jain is None else one(window.jain)


_INSTANCE, _POOL = ("instance", "pool", "role"), ("pool", "role")
# The controller's families, in the order they are exported: one row a metric.
CONTROLLER_FAMILIES: tuple[Family[_Scrape], ...] = (
    Family("pdscope_controller_ticks", "Reconcile ticks attempted.", "counter", (), lambda s: one(s.v.ticks)),
    Family(
        "pdscope_controller_tick_failures",
        "Reconcile ticks that failed.",
        "counter",
        (),
        lambda s: one(s.v.failed_ticks),
    ),
    Family(
        "pdscope_controller_last_success_timestamp_seconds",
        "Unix time of the last successful tick (0 if none).",
        "gauge",
        (),
        lambda s: one(s.v.last_ok or 0.0),
    ),
    Family(
        "pdscope_controller_tick_duration_seconds",
        "Duration of the last successful tick.",
        "gauge",
        (),
        lambda s: one(s.v.tick_seconds or 0.0),
    ),
    Family(
        "pdscope_controller_shadow_ticks",
        "Ticks the shadow policy decided beside the live one.",
        "counter",
        (),
        _shadow(lambda st: st["ticks"]),
    ),
    Family(
        "pdscope_controller_shadow_divergent_ticks",
        "Ticks where the shadow policy would have served or fired differently from the live one.",
        "counter",
        (),
        _shadow(lambda st: st["divergent_ticks"]),
    ),
    Family(
        "pdscope_controller_shadow_failures",
        "Shadow policy steps that raised (the live tick went on).",
        "counter",
        (),
        _shadow(lambda st: st["failures"]),
    ),
    Family(
        "pdscope_controller_shadow_weight",
        "The weight the shadow policy would serve each instance now.",
        "gauge",
        ("instance",),
        _shadow_weights,
    ),
    Family(
        "pdscope_controller_window_reads",
        "Reads of each window the leader keeps between ticks (slo, evidence, snapshots, tenants) by kind: "
        "whole (on taking over, after a failed tick, on a config change, every "
        "controller.whole_read_every_s) or changes (only the rows changed since the last tick).",
        "counter",
        ("window", "kind"),
        lambda s: [
            ((window, kind), float(n))
            for window, whole, changes in s.v.window_reads
            for kind, n in (("whole", whole), ("changes", changes))
        ],
    ),
    Family(
        "pdscope_controller_full_collections",
        "Full garbage collections the serving loop ran itself, once every controller.full_collection_every "
        "ticks (CPython starts none while it runs).",
        "counter",
        (),
        lambda s: one(float(s.v.full_collections[0])),
    ),
    Family(
        "pdscope_controller_full_collection_seconds",
        "CPU seconds of the serving loop's full garbage collections.",
        "counter",
        (),
        lambda s: one(s.v.full_collections[1]),
    ),
    Family(
        "pdscope_controller_tick_record_bytes",
        "Compressed size of the newest tick record (the replay log; 0: none written).",
        "gauge",
        (),
        lambda s: one(s.v.tick_record_bytes or 0),
    ),
    Family(
        "pdscope_controller_enforce",
        "1 in enforce mode, 0 in advisory mode.",
        "gauge",
        (),
        lambda s: one(1.0 if s.v.table.enforce else 0.0),
    ),
    Family(
        "pdscope_routing_version",
        "Version of the served routing table.",
        "gauge",
        (),
        lambda s: one(s.v.table.version),
    ),
    Family(
        "pdscope_controller_leader",
        "1 while this controller leads (runs the policy, writes), 0 while it stands by.",
        "gauge",
        (),
        lambda s: one(1.0 if s.v.role == "leader" else 0.0),
    ),
    Family(
        "pdscope_controller_epoch",
        "The leader epoch: this controller's as leader, the store's leader's as standby (0: none yet).",
        "gauge",
        (),
        lambda s: one(s.v.epoch or 0),
    ),
    Family(
        "pdscope_controller_mode_mismatch",
        "1 while this standby's configured mode differs from the leader's (it serves the leader's).",
        "gauge",
        (),
        _mode_mismatch,
    ),
    Family(
        "pdscope_controller_takeovers",
        "Times this controller took over as leader.",
        "counter",
        (),
        lambda s: one(s.v.takeovers),
    ),
    Family(
        "pdscope_controller_deposed",
        "Ticks that found another leader's epoch in the store (nothing written; now standby).",
        "counter",
        (),
        lambda s: one(s.v.deposed),
    ),
    Family(
        "pdscope_controller_untrusted_records",
        "Request records in the last tick's window left out of the observation: their "
        "sender is not in controller.trusted_span_senders.",
        "gauge",
        (),
        lambda s: one(0 if s.v.obs is None else s.v.obs.untrusted_records),
    ),
    Family(
        "pdscope_instance_weight",
        "Served routing weight per instance.",
        "gauge",
        (*_INSTANCE, "source"),
        lambda s: [((name, r.pool, r.role, x.source), x.weight) for name, r, x in s.served],
    ),
    Family(
        "pdscope_instance_policy_weight",
        "The policy's weight per instance.",
        "gauge",
        _INSTANCE,
        lambda s: [((name, r.pool, r.role), x.policy_weight) for name, r, x in s.served],
    ),
    Family(
        "pdscope_instance_drained",
        "1 if the instance is drained.",
        "gauge",
        _INSTANCE,
        lambda s: [((name, r.pool, r.role), 1.0 if x.drained else 0.0) for name, r, x in s.served],
    ),
    Family(
        "pdscope_pool_weight",
        "Served pool weight.",
        "gauge",
        _POOL,
        lambda s: [((p.name, p.role), p.weight) for p in s.v.table.pools],
    ),
    Family(
        "pdscope_pool_max_inflight_requests",
        "Admission limit: in-flight requests.",
        "gauge",
        _POOL,
        _pool_limit(lambda p: p.max_inflight_requests),
    ),
    Family(
        "pdscope_pool_max_inflight_kv_bytes",
        "Admission limit: handoff KV bytes.",
        "gauge",
        _POOL,
        _pool_limit(lambda p: p.max_inflight_kv_bytes),
    ),
    Family(
        "pdscope_pool_max_queue_wait_seconds",
        "Longest wait for an admission slot (the TTFT budget left).",
        "gauge",
        _POOL,
        _pool_limit(lambda p: p.max_queue_wait_s),
    ),
    Family(
        "pdscope_alerts",
        "Active alerts (pending or firing), like Prometheus' ALERTS.",
        "gauge",
        lambda s: ["alertname", "alertstate", "severity", *s.alert_keys],
        _alerts,
    ),
    Family("pdscope_alerts_firing", "Firing alerts per rule.", "gauge", ("alertname",), _firing),
    Family(
        "pdscope_slo_attainment",
        "Share of completed requests meeting every SLO.",
        "gauge",
        (),
        _observed(lambda slo: slo.attainment),
    ),
    Family(
        "pdscope_goodput_requests_per_second",
        "Requests meeting every SLO per second.",
        "gauge",
        (),
        _observed(lambda slo: slo.goodput_rps),
    ),
    Family(
        "pdscope_tenant_slo_attainment",
        "Share of a tenant's served requests meeting its own SLO targets over slo.window_s.",
        "gauge",
        ("tenant",),
        _per_tenant(lambda t: t.attainment),
    ),
    Family(
        "pdscope_tenant_goodput_tokens_per_second",
        "Prompt and completion tokens per second of a tenant's requests meeting its own SLO targets.",
        "gauge",
        ("tenant",),
        _per_tenant(lambda t: t.goodput_tokens_per_s),
    ),
    Family(
        "pdscope_tenant_service_share",
        "A tenant's share of the window's service (prompt + weighted decode tokens served).",
        "gauge",
        ("tenant",),
        _per_tenant(lambda t: t.service_share),
    ),
    Family(
        "pdscope_tenant_fairness_jain",
        "Jain's index over served tokens / weight of the tenants with demand (1: served by weight).",
        "gauge",
        (),
        _jain,
    ),
    Family(
        "pdscope_alert_webhook_sent",
        "Webhook batches delivered.",
        "counter",
        (),
        lambda s: one(s.notifier.sent),
    ),
    Family(
        "pdscope_alert_webhook_failed",
        "Webhook batches that failed.",
        "counter",
        (),
        lambda s: one(s.notifier.failed),
    ),
    Family(
        "pdscope_alert_webhook_dropped",
        "Webhook batches dropped (queue full).",
        "counter",
        (),
        lambda s: one(s.notifier.dropped),
    ),
    Family(
        "pdscope_bundles_written",
        "Incident bundles written.",
        "counter",
        (),
        lambda s: one(s.reconciler.bundler.written),
    ),
    Family(
        "pdscope_bundles_failed",
        "Incident bundles that failed (see the log).",
        "counter",
        (),
        lambda s: one(s.reconciler.bundler.failed),
    ),
    Family(
        "pdscope_bundles_dropped",
        "Incident bundles dropped unwritten (queue full).",
        "counter",
        (),
        lambda s: one(s.reconciler.bundler.dropped),
    ),
    Family(
        "pdscope_bundles_pending",
        "Incident bundles queued or being written.",
        "gauge",
        (),
        lambda s: one(s.reconciler.bundler.pending),
    ),
)


class ControllerCollector(Collector):
    def __init__(self, reconciler: Reconciler, notifier: Notifier) -> None:
        self.reconciler = reconciler
        self.notifier = notifier

    def collect(self) -> Iterator[Metric]:
        return families(CONTROLLER_FAMILIES, _Scrape(self.reconciler, self.notifier))


def _tally(keys: Sequence[str], counts: Mapping[str, int]) -> list[Sample]:
    """One sample per key, in ``keys``' order (0 for a key not counted yet)."""
    held = dict(counts)  # a copy: polls count it from other threads
    return [((key,), float(held.get(key, 0))) for key in keys]


# The routing polls' families, in the order they are exported: one row a metric.
PROXIES_FAMILIES: tuple[Family[ProxyRegistry], ...] = (
    Family(
        "pdscope_controller_proxy_polls",
        "Routing polls with a proxy report, by outcome (ok, new, restarted, bad_report, "
        "unauthenticated: 401, wrong_id: 403, the credential is another id's; duplicate_id: the table "
        "without a part, another live process holds the id; over_limit: no seat for a new id; "
        "store_error: served without a share).",
        "counter",
        ("outcome",),
        lambda p: _tally(OUTCOMES, p.polls),
    ),
    Family(
        "pdscope_controller_proxy_claims_clipped",
        "Pools of proxy reports whose claim was clipped to what the controller can grant, by kind "
        "(inflight: past the part last granted plus a margin; demand: growth past the rate bound; "
        "tenant: a tenant's demand past that bound, or a tenant not declared, dropped).",
        "counter",
        ("kind",),
        lambda p: _tally(CLAIMS, p.clipped),
    ),
    Family(
        "pdscope_controller_live_proxies",
        "Live proxies the pools' limits were split among at the last poll this replica answered.",
        "gauge",
        (),
        lambda p: one(p.live),
    ),
    Family(
        "pdscope_controller_proxies_departed",
        "Proxies that left the live set (no routing poll within controller.proxy_ttl_s), as this "
        "replica's polls saw it; their parts went to the others.",
        "counter",
        (),
        lambda p: one(p.departed),
    ),
)


class ProxiesCollector(Collector):
    """The routing polls this replica answered, and the live proxies at the last one."""

    def __init__(self, proxies: ProxyRegistry) -> None:
        self.proxies = proxies

    def collect(self) -> Iterator[Metric]:
        return families(PROXIES_FAMILIES, self.proxies)


def make_registry(
    reconciler: Reconciler, notifier: Notifier, proxies: ProxyRegistry | None = None
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ControllerCollector(reconciler, notifier))
    registry.register(FlapTally(reconciler.factory, reconciler.settings, reconciler.clock))
    if proxies is not None:
        registry.register(ProxiesCollector(proxies))
    return registry
