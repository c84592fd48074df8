"""The controller's own Prometheus metrics, read from the reconciler at scrape time.

A custom collector on a per-app registry (no global registry): every scrape reports the
current values, so an alert that resolved or an instance that left leaves no stale
series behind. Alerts are exported the way Prometheus exports its own,
``pdscope_alerts{alertname, alertstate, severity, ...labels} 1``, by the leader only (a standby
evaluates no rule), so two replicas never double an alert's series.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controller.leader import mode_warning
from controller.loop import Reconciler
from controller.notify import Notifier
from controller.proxies import CLAIMS, OUTCOMES, ProxyRegistry
from controller.regret import FlapTally


def _shadow(status: dict[str, Any] | None) -> Iterator[Metric]:
    """The shadow policy's series (``controller.shadow``); none without a shadow."""
    if status is None:
        return
    yield CounterMetricFamily(
        "pdscope_controller_shadow_ticks",
        "Ticks the shadow policy decided beside the live one.",
        value=status["ticks"],
    )
    yield CounterMetricFamily(
        "pdscope_controller_shadow_divergent_ticks",
        "Ticks where the shadow policy would have served or fired differently from the live one.",
        value=status["divergent_ticks"],
    )
    yield CounterMetricFamily(
        "pdscope_controller_shadow_failures",
        "Shadow policy steps that raised (the live tick went on).",
        value=status["failures"],
    )
    w = GaugeMetricFamily(
        "pdscope_controller_shadow_weight",
        "The weight the shadow policy would serve each instance now.",
        labels=["instance"],
    )
    for name, pair in status["weights"].items():
        w.add_metric([name], pair["shadow"])
    yield w


class ControllerCollector(Collector):
    def __init__(self, reconciler: Reconciler, notifier: Notifier) -> None:
        self.reconciler = reconciler
        self.notifier = notifier

    def collect(self) -> Iterator[Metric]:
        v = self.reconciler.view()
        yield CounterMetricFamily("pdscope_controller_ticks", "Reconcile ticks attempted.", value=v.ticks)
        yield CounterMetricFamily(
            "pdscope_controller_tick_failures", "Reconcile ticks that failed.", value=v.failed_ticks
        )
        yield GaugeMetricFamily(
            "pdscope_controller_last_success_timestamp_seconds",
            "Unix time of the last successful tick (0 if none).",
            value=v.last_ok or 0.0,
        )
        yield GaugeMetricFamily(
            "pdscope_controller_tick_duration_seconds",
            "Duration of the last successful tick.",
            value=v.tick_seconds or 0.0,
        )
        yield from _shadow(self.reconciler.shadow_status())
        yield GaugeMetricFamily(
            "pdscope_controller_tick_record_bytes",
            "Compressed size of the newest tick record (the replay log; 0: none written).",
            value=v.tick_record_bytes or 0,
        )
        yield GaugeMetricFamily(
            "pdscope_controller_enforce",
            "1 in enforce mode, 0 in advisory mode.",
            value=1.0 if v.table.enforce else 0.0,
        )
        yield GaugeMetricFamily(
            "pdscope_routing_version", "Version of the served routing table.", value=v.table.version
        )
        yield GaugeMetricFamily(
            "pdscope_controller_leader",
            "1 while this controller leads (runs the policy, writes), 0 while it stands by.",
            value=1.0 if v.role == "leader" else 0.0,
        )
        yield GaugeMetricFamily(
            "pdscope_controller_epoch",
            "The leader epoch: this controller's as leader, the store's leader's as standby (0: none yet).",
            value=v.epoch or 0,
        )
        yield GaugeMetricFamily(
            "pdscope_controller_mode_mismatch",
            "1 while this standby's configured mode differs from the leader's (it serves the leader's).",
            value=0.0 if mode_warning(v.role, self.reconciler.mode, v.leader) is None else 1.0,
        )
        yield CounterMetricFamily(
            "pdscope_controller_takeovers", "Times this controller took over as leader.", value=v.takeovers
        )
        yield CounterMetricFamily(
            "pdscope_controller_deposed",
            "Ticks that found another leader's epoch in the store (nothing written; now standby).",
            value=v.deposed,
        )
        yield GaugeMetricFamily(
            "pdscope_controller_untrusted_records",
            "Request records in the last tick's window left out of the observation: their "
            "sender is not in controller.trusted_span_senders.",
            value=0 if v.obs is None else v.obs.untrusted_records,
        )

        served = GaugeMetricFamily(
            "pdscope_instance_weight",
            "Served routing weight per instance.",
            labels=["instance", "pool", "role", "source"],
        )
        policy = GaugeMetricFamily(
            "pdscope_instance_policy_weight",
            "The policy's weight per instance.",
            labels=["instance", "pool", "role"],
        )
        drained = GaugeMetricFamily(
            "pdscope_instance_drained", "1 if the instance is drained.", labels=["instance", "pool", "role"]
        )
        by_name = {r.name: r for r in v.table.instances}
        for name, s in v.served.items():
            r = by_name.get(name)
            if r is None:
                continue
            served.add_metric([name, r.pool, r.role, s.source], s.weight)
            policy.add_metric([name, r.pool, r.role], s.policy_weight)
            drained.add_metric([name, r.pool, r.role], 1.0 if s.drained else 0.0)
        yield served
        yield policy
        yield drained

        reqs = GaugeMetricFamily(
            "pdscope_pool_max_inflight_requests",
            "Admission limit: in-flight requests.",
            labels=["pool", "role"],
        )
        kvb = GaugeMetricFamily(
            "pdscope_pool_max_inflight_kv_bytes",
            "Admission limit: handoff KV bytes.",
            labels=["pool", "role"],
        )
        wait = GaugeMetricFamily(
            "pdscope_pool_max_queue_wait_seconds",
            "Longest wait for an admission slot (the TTFT budget left).",
            labels=["pool", "role"],
        )
        pw = GaugeMetricFamily("pdscope_pool_weight", "Served pool weight.", labels=["pool", "role"])
        for p in v.table.pools:
            pw.add_metric([p.name, p.role], p.weight)
            if p.max_inflight_requests is not None:
                reqs.add_metric([p.name, p.role], p.max_inflight_requests)
            if p.max_inflight_kv_bytes is not None:
                kvb.add_metric([p.name, p.role], p.max_inflight_kv_bytes)
            if p.max_queue_wait_s is not None:
                wait.add_metric([p.name, p.role], p.max_queue_wait_s)
        yield pw
        yield reqs
        yield kvb
        yield wait

        active = v.last.alerts.active if v.last is not None else ()
        keys = sorted({k for a in active for k in a.labels})
        alerts = GaugeMetricFamily(
            "pdscope_alerts",
            "Active alerts (pending or firing), like Prometheus' ALERTS.",
            labels=["alertname", "alertstate", "severity", *keys],
        )
        for a in active:
            alerts.add_metric([a.rule, a.state, a.severity, *(a.labels.get(k, "") for k in keys)], 1.0)
        yield alerts
        firing = GaugeMetricFamily("pdscope_alerts_firing", "Firing alerts per rule.", labels=["alertname"])
        counts: dict[str, int] = {}
        for a in active:
            if a.state == "firing":
                counts[a.rule] = counts.get(a.rule, 0) + 1
        for rule in self.reconciler.rules:
            firing.add_metric([rule.name], counts.get(rule.name, 0))
        yield firing

        if v.obs is not None:
            slo = v.obs.slo
            g = GaugeMetricFamily("pdscope_slo_attainment", "Share of completed requests meeting every SLO.")
            if slo.attainment is not None:
                g.add_metric([], slo.attainment)
            yield g
            yield GaugeMetricFamily(
                "pdscope_goodput_requests_per_second",
                "Requests meeting every SLO per second.",
                value=slo.goodput_rps,
            )

        n = self.notifier
        yield CounterMetricFamily("pdscope_alert_webhook_sent", "Webhook batches delivered.", value=n.sent)
        yield CounterMetricFamily(
            "pdscope_alert_webhook_failed", "Webhook batches that failed.", value=n.failed
        )
        yield CounterMetricFamily(
            "pdscope_alert_webhook_dropped", "Webhook batches dropped (queue full).", value=n.dropped
        )
        b = self.reconciler.bundler
        yield CounterMetricFamily("pdscope_bundles_written", "Incident bundles written.", value=b.written)
        yield CounterMetricFamily(
            "pdscope_bundles_failed", "Incident bundles that failed (see the log).", value=b.failed
        )
        yield CounterMetricFamily(
            "pdscope_bundles_dropped", "Incident bundles dropped unwritten (queue full).", value=b.dropped
        )
        yield GaugeMetricFamily(
            "pdscope_bundles_pending", "Incident bundles queued or being written.", value=b.pending
        )


class ProxiesCollector(Collector):
    """The routing polls this replica answered, and the live proxies at the last one."""

    def __init__(self, proxies: ProxyRegistry) -> None:
        self.proxies = proxies

    def collect(self) -> Iterator[Metric]:
        polls = CounterMetricFamily(
            "pdscope_controller_proxy_polls",
            "Routing polls with a proxy report, by outcome (ok, new, restarted, bad_report, "
            "unauthenticated: 401, wrong_id: 403, the credential is another id's; duplicate_id: the table "
            "without a part, another live process holds the id; over_limit: no seat for a new id; "
            "store_error: served without a share).",
            labels=["outcome"],
        )
        counts = dict(self.proxies.polls)
        for outcome in OUTCOMES:
            polls.add_metric([outcome], float(counts.get(outcome, 0)))
        yield polls
        clipped = CounterMetricFamily(
            "pdscope_controller_proxy_claims_clipped",
            "Pools of proxy reports whose claim was clipped to what the controller can grant, by kind "
            "(inflight: past the part last granted plus a margin; demand: growth past the rate bound).",
            labels=["kind"],
        )
        held = dict(self.proxies.clipped)
        for kind in CLAIMS:
            clipped.add_metric([kind], float(held.get(kind, 0)))
        yield clipped
        yield GaugeMetricFamily(
            "pdscope_controller_live_proxies",
            "Live proxies the pools' limits were split among at the last poll this replica answered.",
            value=self.proxies.live,
        )
        yield CounterMetricFamily(
            "pdscope_controller_proxies_departed",
            "Proxies that left the live set (no routing poll within controller.proxy_ttl_s), as this "
            "replica's polls saw it; their parts went to the others.",
            value=self.proxies.departed,
        )


def make_registry(
    reconciler: Reconciler, notifier: Notifier, proxies: ProxyRegistry | None = None
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ControllerCollector(reconciler, notifier))
    registry.register(FlapTally(reconciler.factory, reconciler.settings, reconciler.clock))
    if proxies is not None:
        registry.register(ProxiesCollector(proxies))
    return registry
