"""The proxy's own Prometheus metrics (``GET /metrics``), in a registry of its own.

Counters are bumped on the request path (pre-bound children where the labels are
fixed); gauges that mirror live state (in-flight per pool and instance, routing state,
span queue) are read from that state, named once in :class:`LiveSources`, at scrape
time by :class:`_LiveCollector`, so the request path never updates them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from proxy.routing import STATES

if TYPE_CHECKING:
    from proxy.admission import Admission
    from proxy.kvsubscriber import KvEventsSubscriber
    from proxy.kvtrust import HitCheck
    from proxy.routing import RoutingState
    from proxy.selection import RetryBudget, Selector
    from proxy.tracing import BoundedSpanProcessor

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True)
class LiveSources:
    """The live proxy state the scrape-time gauges and counters are read from."""

    routing: RoutingState
    admission: Admission
    selector: Selector
    budget: RetryBudget
    spans: BoundedSpanProcessor | None
    now: Callable[[], float]
    kv_events: KvEventsSubscriber | None = None  # precise KV-aware routing's subscriber, when it runs
    kv_trust: HitCheck | None = None  # precise KV-aware routing's check of predicted against reported hits


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "pdscope_proxy_requests",
            "Client requests by endpoint and outcome.",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.rejections = Counter(
            "pdscope_proxy_rejections",
            "Requests rejected by admission (429; 503 for no_instances, counted in "
            "every pool of the role), by pool name and reason.",
            ["pool", "reason"],
            registry=r,
        )
        self.retries = Counter(
            "pdscope_proxy_retries",
            "Retries by stage: prefill (another P), decode (another D, same "
            "KV), full (new prefill and another D).",
            ["stage"],
            registry=r,
        )
        self.retries_refused = Counter(
            "pdscope_proxy_retries_refused",
            "Retries not made because the retry budget was spent.",
            ["stage"],
            registry=r,
        )
        self.upstream_failures = Counter(
            "pdscope_proxy_upstream_failures",
            "Failed upstream calls by instance, stage and kind.",
            ["instance", "stage", "kind"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "pdscope_proxy_client_disconnects",
            "Clients that went away; upstream streams were closed.",
            ["stage"],
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "pdscope_proxy_prefill_seconds",
            "Proxy-observed prefill call time.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "pdscope_proxy_time_to_first_token_seconds",
            "Proxy arrival to D's first byte.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.client_read_timeouts = Counter(
            "pdscope_proxy_client_read_timeouts",
            "Client connections closed because the request's headers "
            "or body did not arrive within proxy.client_read_timeout_s.",
            ["phase"],
            registry=r,
        )
        self.request_too_large = Counter(
            "pdscope_proxy_request_too_large",
            "Client bodies over proxy.max_request_bytes (413).",
            registry=r,
        )
        # KV-aware routing (proxy.gate, proxy.kvaware); counted only while a cache view is in use
        self.routes = Counter(
            "pdscope_proxy_routes",
            "Admitted requests routed with a cache view (proxy.kv_aware), by path (pd: P then D; "
            "decode_only: D alone) and reason (affinity, load, affinity_bounded, no_prompt, view_error, "
            "decode_only_short, decode_only_cached).",
            ["path", "reason"],
            registry=r,
        )
        self.predicted_cached = Counter(
            "pdscope_proxy_predicted_cached_tokens",
            "Prompt tokens the cache view predicted the chosen instance holds, by role (prefill, decode): "
            "against vLLM's own prefix-cache hits.",
            ["role"],
            registry=r,
        )
        self.prompt_tokens_routed = Counter(
            "pdscope_proxy_prompt_tokens_routed",
            "Prompt tokens (as the view counts them) of the requests routed with a keyed prompt.",
            registry=r,
        )
        self.kv_view_errors = Counter(
            "pdscope_proxy_kv_view_errors",
            "Cache view calls that failed (call: prompt, cached, routed); the request routed load-only.",
            ["call"],
            registry=r,
        )
        self._outcome_children: dict[tuple[str, str], Callable[[], None]] = {}

    def count_request(self, endpoint: str, outcome: str) -> None:
        inc = self._outcome_children.get((endpoint, outcome))
        if inc is None:
            inc = self.requests.labels(endpoint, outcome).inc
            self._outcome_children[(endpoint, outcome)] = inc
        inc()

    def watch(self, sources: LiveSources) -> None:
        self.registry.register(_LiveCollector(sources))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LiveCollector(Collector):
    def __init__(self, sources: LiveSources) -> None:
        self.sources = sources

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        routing, admission, spans = self.sources.routing, self.sources.admission, self.sources.spans
        state = GaugeMetricFamily(
            "pdscope_proxy_routing_state",
            "1 for the routing state in force: fresh (controller's table), static (last table kept, "
            "controller unreachable), fallback (equal weights), default (no table yet, no poll failed), "
            "never_reached (no controller answered since start: equal weights), advisory.",
            labels=["state"],
        )
        for s in STATES:
            state.add_metric([s], 1.0 if routing.state == s else 0.0)
        yield state
        version = GaugeMetricFamily(
            "pdscope_proxy_routing_table_version", "Version of the table in force (-1: none)."
        )
        v = routing.view.version
        version.add_metric([], float(-1 if v is None else v))
        yield version
        age = GaugeMetricFamily(
            "pdscope_proxy_routing_table_age_seconds", "Seconds since the last good poll (-1: never)."
        )
        a = routing.age(self.sources.now())
        age.add_metric([], -1.0 if a is None else a)
        yield age
        polls = CounterMetricFamily(
            "pdscope_proxy_routing_poll_failures", "Failed polls of the routing table."
        )
        polls.add_metric([], float(routing.poll_failures))
        yield polls
        req = GaugeMetricFamily(
            "pdscope_proxy_pool_inflight_requests", "Admitted requests per pool.", labels=["pool"]
        )
        for pool, n in sorted(admission.requests.items()):
            req.add_metric([pool], float(n))
        yield req
        kvb = GaugeMetricFamily(
            "pdscope_proxy_pool_inflight_kv_bytes", "Handoff KV bytes in flight per pool.", labels=["pool"]
        )
        for pool, n in sorted(admission.kv_bytes.items()):
            kvb.add_metric([pool], float(n))
        yield kvb
        dem = CounterMetricFamily(
            "pdscope_proxy_pool_demand",
            "Requests that sought admission into each pool (admitted or not): what the controller "
            "splits the pools' limits among proxies by.",
            labels=["pool"],
        )
        for pool, n in sorted(admission.demand.items()):
            dem.add_metric([pool], float(n))
        yield dem
        lim_in_force = GaugeMetricFamily(
            "pdscope_proxy_pool_limit",
            "The limits this proxy enforces per pool (its part of the pool's, or the config's "
            "divided by proxy.expected_replicas), kind requests or kv_bytes.",
            labels=["pool", "kind"],
        )
        for pool, limits in sorted(routing.view.limits.items()):
            lim_in_force.add_metric([pool, "requests"], float(limits.max_inflight_requests))
            lim_in_force.add_metric([pool, "kv_bytes"], float(limits.max_inflight_kv_bytes))
        yield lim_in_force
        share = routing.current_share(self.sources.now())
        frac = GaugeMetricFamily(
            "pdscope_proxy_limit_share",
            "This proxy's fraction of each pool's limits as the controller last gave it "
            "(absent: no part, the config's limits divided by proxy.expected_replicas apply).",
            labels=["pool"],
        )
        for pool, part in sorted(({} if share is None else share.pools).items()):
            frac.add_metric([pool], part.share)
        yield frac
        yield GaugeMetricFamily(
            "pdscope_proxy_live_proxies",
            "Live proxies the controller split the limits among at this proxy's last part (0: none).",
            value=0.0 if share is None else float(share.live),
        )
        waiting = GaugeMetricFamily("pdscope_proxy_admission_waiting", "Requests waiting for admission.")
        waiting.add_metric([], float(admission.waiting))
        yield waiting
        inst = GaugeMetricFamily(
            "pdscope_proxy_instance_inflight", "In-flight upstream calls per instance.", labels=["instance"]
        )
        for name, n in sorted(self.sources.selector.inflight.items()):
            inst.add_metric([name], float(n))
        yield inst
        now = self.sources.now()
        outliers = self.sources.selector.outliers
        ej = CounterMetricFamily(
            "pdscope_proxy_outlier_ejections",
            "Outlier ejections by instance and reason (consecutive_failures, "
            "failure_ratio, probation: the first failure after a return).",
            labels=["instance", "reason"],
        )
        for (name, reason), n in sorted(outliers.ejections.items()):
            ej.add_metric([name, reason], float(n))
        yield ej
        out = GaugeMetricFamily(
            "pdscope_proxy_instance_ejected",
            "1 while outlier detection keeps the instance out of selection.",
            labels=["instance"],
        )
        for name in outliers.instances():
            out.add_metric([name], 1.0 if outliers.is_ejected(name, now) else 0.0)
        yield out
        adaptive = admission.adaptive
        if adaptive is not None:
            lim = GaugeMetricFamily(
                "pdscope_proxy_pool_adaptive_limit",
                "Requests a pool admits now: its adaptive limit (AIMD on the "
                "proxy's own TTFT), never above the limit in force.",
                labels=["pool"],
            )
            for pool, limits in sorted(routing.view.limits.items()):
                lim.add_metric([pool], float(adaptive.limit(pool, limits.max_inflight_requests)))
            yield lim
        bal = GaugeMetricFamily("pdscope_proxy_retry_budget_balance", "Retries the budget allows now.")
        bal.add_metric([], self.sources.budget.balance)
        yield bal
        if spans is not None:
            for name, value, doc in (
                (
                    "pdscope_proxy_spans_dropped",
                    spans.dropped,
                    "Spans lost because the queue or the buffer of unsampled traces' children was "
                    "full (or still there at shutdown).",
                ),
                (
                    "pdscope_proxy_spans_unsampled",
                    spans.unsampled,
                    "Child spans not exported by sampling (proxy.trace_sample_ratio): their trace was "
                    "not sampled, did not fail and met the TTFT SLO.",
                ),
                ("pdscope_proxy_spans_exported", spans.exported, "Spans the collector accepted."),
                (
                    "pdscope_proxy_spans_export_failed",
                    spans.failed,
                    "Spans in failed export tries (a batch retried n times counts n times).",
                ),
                (
                    "pdscope_proxy_spans_rejected",
                    spans.rejected,
                    "Spans in batches the collector refused for good (4xx other than 408/429): lost.",
                ),
                ("pdscope_proxy_spans_export_retries", spans.retries, "Retried tries of a held span batch."),
            ):
                c = CounterMetricFamily(name, doc)
                c.add_metric([], float(value))
                yield c
            q = GaugeMetricFamily("pdscope_proxy_spans_queued", "Spans waiting to be exported.")
            q.add_metric([], float(spans.queued))
            yield q
        yield from self._kv()

    def _kv(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        if self.sources.kv_events is not None:
            yield from _kv_events(self.sources.kv_events)
        if self.sources.kv_trust is not None:
            yield _kv_trust(self.sources.kv_trust)


def _kv_trust(check: HitCheck) -> CounterMetricFamily:
    fam = CounterMetricFamily(
        "pdscope_proxy_kv_hit_checks",
        "Precise KV-aware routing's predictions checked against the cached tokens the instance reported, "
        "per instance and verdict: hit, miss (less than half came true), distrusted (its events no longer "
        "credited, see docs/trust.md), trusted (credited again after probation).",
        labels=["instance", "verdict"],
    )
    for (inst, verdict), n in sorted(dict(check.counts).items()):
        fam.add_metric([inst, verdict], float(n))
    return fam


def _kv_events(sub: KvEventsSubscriber) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The KV events subscriber's counts and the prefix index, per instance, read at scrape time
    (copies: the subscriber's thread writes them)."""
    c = sub.counts
    names = sorted(sub.sources)
    by_instance = (
        ("pdscope_proxy_kv_events_messages", dict(c.messages), "KV event messages decoded, per instance."),
        (
            "pdscope_proxy_kv_events_gaps",
            dict(c.gaps),
            "Gaps in an instance's event sequence (messages lost: replayed, or its view rebuilt).",
        ),
        (
            "pdscope_proxy_kv_events_restarts",
            dict(c.restarts),
            "Publishers that restarted their sequence (a restarted instance: its view is forgotten).",
        ),
        (
            "pdscope_proxy_kv_events_skipped_events",
            dict(c.skipped_events),
            "Events of a kind pdscope does not know, skipped inside decoded messages.",
        ),
        (
            "pdscope_proxy_kv_events_rebuilds",
            dict(c.rebuilds),
            "Times an instance's view was forgotten to be rebuilt from its next events.",
        ),
    )
    for name, counts, doc in by_instance:
        fam = CounterMetricFamily(name, doc, labels=["instance"])
        for inst in names:
            fam.add_metric([inst], float(counts.get(inst, 0)))
        yield fam
    for name, pairs, label, doc in (
        (
            "pdscope_proxy_kv_events_dropped",
            dict(c.dropped),
            "reason",
            "KV event messages dropped, per instance and reason (undecodable, duplicate, "
            "unknown_instance, ...).",
        ),
        (
            "pdscope_proxy_kv_events_replays",
            dict(c.replays),
            "outcome",
            "Replays asked of an instance's replay socket after a gap, by outcome (ok, failed).",
        ),
    ):
        fam = CounterMetricFamily(name, doc, labels=["instance", label])
        for (inst, what), n in sorted(pairs.items()):
            fam.add_metric([inst, what], float(n))
        yield fam
    loops = CounterMetricFamily(
        "pdscope_proxy_kv_events_loop_errors", "Failures of the subscriber's loop (logged; it went on)."
    )
    loops.add_metric([], float(c.loop_errors))
    yield loops
    now = sub.clock()
    last = dict(c.last_message)
    age = GaugeMetricFamily(
        "pdscope_proxy_kv_events_last_message_age_seconds",
        "Seconds since the instance's last KV event message (-1: none yet). An idle instance publishes "
        "nothing: read it with the instance's traffic.",
        labels=["instance"],
    )
    for inst in names:
        seen = last.get(inst)
        age.add_metric([inst], -1.0 if seen is None else max(0.0, now - seen))
    yield age
    with sub.lock:  # the index is the thread's: its sizes are read under its lock (microseconds)
        blocks = {inst: sub.index.blocks(inst) for inst in names}
        stale = {inst: inst in sub.index.stale for inst in names}
    held = GaugeMetricFamily(
        "pdscope_proxy_kv_index_blocks",
        "KV blocks the prefix index holds for the instance.",
        labels=["instance"],
    )
    st = GaugeMetricFamily(
        "pdscope_proxy_kv_index_stale",
        "1 while the instance's view is stale (credited nothing until rebuilt).",
        labels=["instance"],
    )
    for inst in names:
        held.add_metric([inst], float(blocks[inst]))
        st.add_metric([inst], 1.0 if stale[inst] else 0.0)
    yield held
    yield st
