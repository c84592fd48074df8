"""The proxy's per-tenant metrics (with ``tenants.enabled`` only; off, the proxy exports none of them).

The ``tenant`` label takes only the declared ids (``tenants.tenants``: at most 64): a request's
tenant is always one of them (``proxy.tenants``), so the label's cardinality is the config's.
Counters and the histogram are bumped on the request path; the gauges (in flight, waiting, service
rates, Jain's index, weight scales) are read from the fair queue at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.fairqueue import FairQueue

QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry, fair: FairQueue) -> None:
        self.admitted = Counter(
            "pdscope_proxy_tenant_admitted",
            "Requests admitted into the pools, by tenant.",
            ["tenant"],
            registry=registry,
        )
        self.rejections = Counter(
            "pdscope_proxy_tenant_rejections",
            "Requests refused at admission, by tenant and reason: the pools' reasons (inflight_requests, "
            "queue_full, predicted_late, ...) and the tenants' (tenant_rate, tenant_quota, "
            "tenant_queue_full, shed_for_priority, tenant_reserve).",
            ["tenant", "reason"],
            registry=registry,
        )
        self.queued = Histogram(
            "pdscope_proxy_tenant_queued_seconds",
            "Time from a request's arrival at admission to its admission (admitted ones), by tenant.",
            ["tenant"],
            buckets=QUEUE_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter(
            "pdscope_proxy_tenant_tokens",
            "Tokens of admitted requests by tenant and kind: prompt (the proxy's count at admission) "
            "and output (as the answer's usage reported them).",
            ["tenant", "kind"],
            registry=registry,
        )
        self.unresolved = Counter(
            "pdscope_proxy_tenant_unresolved",
            "Requests whose tenant source had a problem (too_long, malformed, unknown, unknown_key): "
            "counted as the default tenant's, or refused (400) with tenants.unknown: refuse.",
            ["reason"],
            registry=registry,
        )
        self.client_priority = Counter(
            "pdscope_proxy_tenant_client_priority",
            "Requests that came with their own priority, by tenant: removed, never sent upstream (the "
            "proxy sets it for priority-scheduled instances).",
            ["tenant"],
            registry=registry,
        )
        registry.register(_Live(fair))


class _Live(Collector):
    def __init__(self, fair: FairQueue) -> None:
        self.fair = fair

    def collect(self) -> Iterator[Metric]:
        fair, names = self.fair, sorted(self.fair.tenants)
        yield _gauge(
            "pdscope_proxy_tenant_inflight",
            "Admitted requests in flight, by tenant.",
            {n: float(fair.inflight[n]) for n in names},
        )
        yield _gauge(
            "pdscope_proxy_tenant_waiting",
            "Requests waiting in the fair queue, by tenant.",
            {n: float(fair.queued(n)) for n in names},
        )
        yield _gauge(
            "pdscope_proxy_tenant_service_rate",
            "Each tenant's service over its weight (prompt tokens computed plus weighted decode tokens), "
            "decayed over 10 s: equal values are equal weighted shares.",
            fair.service_rates(),
        )
        yield _gauge(
            "pdscope_proxy_tenant_weight_scale",
            "The scale of each tenant's weight here: this proxy's fraction of the tenant's demand "
            "across the proxies, from the controller (1: alone, or not given).",
            {n: fair.tenants[n].scale for n in names},
        )
        jain = fair.jain()
        g = GaugeMetricFamily(
            "pdscope_proxy_tenant_fairness_jain",
            "Jain's index of the weighted service rates of the tenants backlogged within the last 10 s "
            "(1: shares even by weight; 1/n: one tenant served; absent: none backlogged).",
        )
        if jain is not None:
            g.add_metric([], jain)
        yield g


def _gauge(name: str, doc: str, values: dict[str, float]) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["tenant"])
    for tenant in sorted(values):
        g.add_metric([tenant], values[tenant])
    return g
