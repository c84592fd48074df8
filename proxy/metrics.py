"""The proxy's own Prometheus metrics (``GET /metrics``), in a registry of its own.

Counters are bumped on the request path (pre-bound children where the labels are
fixed); gauges that mirror live state (in-flight per pool and instance, routing state,
span queue) are read from that state, named once in :class:`LiveSources`, at scrape
time by :class:`_LiveCollector`, so the request path never updates them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from pdscope.metricfamilies import Family, Sample, Samples, by_key, families, one
from proxy.routing import STATES

if TYPE_CHECKING:
    from pdscope.routing import ProxyShare
    from proxy.admission import Admission
    from proxy.kvsubscriber import Counts, KvEventsSubscriber
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
    kv_trust: HitCheck | None = None  # KV-aware routing's check of predicted against reported hits


PREDICTION_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._request_families(self.registry)
        self._handoff_families(self.registry)
        self._client_families(self.registry)
        self._latency_families(self.registry)
        self._kv_families(self.registry)
        self._outcome_children: dict[tuple[str, str], Callable[[], None]] = {}

    def _request_families(self, r: CollectorRegistry) -> None:
        """What became of the requests: outcomes, rejections, retries, failures, bad clients."""
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

    def _handoff_families(self, r: CollectorRegistry) -> None:
        self.push_early = Counter(
            "pdscope_proxy_push_early_legs",
            "Push mode: D legs sent with P's, by what became of them: kept (P's answer named the engine "
            "D registered with), void (another engine answered: resent), cancelled (P failed).",
            ["outcome"],
            registry=r,
        )
        self.engine_changes = Counter(
            "pdscope_proxy_engine_changes",
            "P answers that named another NIXL engine id than the P's previous answer (a restart).",
            ["instance"],
            registry=r,
        )

    def _client_families(self, r: CollectorRegistry) -> None:
        """Clients the proxy closed on: too slow to send, or too large."""
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

    def _latency_families(self, r: CollectorRegistry) -> None:
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
        self.ttft_prediction_ratio = Histogram(
            "pdscope_proxy_ttft_prediction_ratio",
            "Observed over predicted TTFT of each request admitted with a prediction (1: exact), by its "
            "P pool (D's when it went to D alone): the TTFT predictor's error (proxy.predict).",
            ["pool"],
            buckets=PREDICTION_RATIO_BUCKETS,
            registry=r,
        )

    def _kv_families(self, r: CollectorRegistry) -> None:
        """KV-aware routing (proxy.gate, proxy.kvaware): counted only while a cache view is in use."""
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


class _Scrape:
    """One scrape's reads of the live sources: the clock once, the proxy's part of the limits once, and
    the prefix index's sizes once, under its lock (the subscriber's thread writes it)."""

    def __init__(self, sources: LiveSources) -> None:
        self.src = sources
        self.now = sources.now()

    @cached_property
    def share(self) -> ProxyShare | None:
        return self.src.routing.current_share(self.now)

    @cached_property
    def kv_names(self) -> list[str]:
        return sorted(self.src.kv_events.sources) if self.src.kv_events is not None else []

    @cached_property
    def kv_index(self) -> tuple[dict[str, int], dict[str, bool]]:
        """(blocks, stale) per instance: read under the index's lock (microseconds)."""
        sub = self.src.kv_events
        if sub is None:
            return {}, {}
        with sub.lock:
            return (
                {inst: sub.index.blocks(inst) for inst in self.kv_names},
                {inst: inst in sub.index.stale for inst in self.kv_names},
            )


Read = Callable[[_Scrape], Samples]


def _table_age(s: _Scrape) -> list[Sample]:
    age = s.src.routing.age(s.now)
    return one(-1.0 if age is None else age)


def _pool_limits(s: _Scrape) -> list[Sample]:
    return [
        sample
        for pool, lim in sorted(s.src.routing.view.limits.items())
        for sample in (
            ((pool, "requests"), float(lim.max_inflight_requests)),
            ((pool, "kv_bytes"), float(lim.max_inflight_kv_bytes)),
        )
    ]


def _adaptive_limits(s: _Scrape) -> Samples:
    adaptive = s.src.admission.adaptive
    if adaptive is None:
        return None
    limits = sorted(s.src.routing.view.limits.items())
    return [((pool,), float(adaptive.limit(pool, lim.max_inflight_requests))) for pool, lim in limits]


def _ejected(s: _Scrape) -> list[Sample]:
    outliers = s.src.selector.outliers
    return [((name,), 1.0 if outliers.is_ejected(name, s.now) else 0.0) for name in outliers.instances()]


def _spans(read: Callable[[BoundedSpanProcessor], int]) -> Read:
    """A count of the span exporter's, absent without one."""
    return lambda s: None if s.src.spans is None else one(float(read(s.src.spans)))


def _kv_count(read: Callable[[Counts], Mapping[str, int]]) -> Read:
    """A per-instance count of the KV events subscriber's (0 for an instance not counted yet)."""

    def samples(s: _Scrape) -> Samples:
        if s.src.kv_events is None:
            return None
        counts = dict(read(s.src.kv_events.counts))  # a copy: the subscriber's thread writes it
        return [((inst,), float(counts.get(inst, 0))) for inst in s.kv_names]

    return samples


def _kv_pairs(read: Callable[[Counts], Mapping[tuple[str, str], int]]) -> Read:
    """A per-instance count of the KV events subscriber's with a second label (a reason, an outcome)."""
    return lambda s: (
        None
        if s.src.kv_events is None
        else [(pair, float(n)) for pair, n in sorted(dict(read(s.src.kv_events.counts)).items())]
    )


def _kv_age(s: _Scrape) -> Samples:
    sub = s.src.kv_events
    if sub is None:
        return None
    now, last = sub.clock(), dict(sub.counts.last_message)
    seen = {inst: last.get(inst) for inst in s.kv_names}
    return [((inst,), -1.0 if t is None else max(0.0, now - t)) for inst, t in seen.items()]


def _kv_index(pick: Callable[[tuple[dict[str, int], dict[str, bool]]], Mapping[str, float]]) -> Read:
    return lambda s: (
        None if s.src.kv_events is None else [((inst,), float(pick(s.kv_index)[inst])) for inst in s.kv_names]
    )


def _hit_checks(s: _Scrape) -> Samples:
    check = s.src.kv_trust
    return None if check is None else [(pair, float(n)) for pair, n in sorted(dict(check.counts).items())]


def _checked_tokens(s: _Scrape) -> Samples:
    check = s.src.kv_trust
    return None if check is None else [(pair, float(n)) for pair, n in sorted(dict(check.tokens).items())]


_INSTANCE, _POOL = ("instance",), ("pool",)
# The scrape-time families, in the order they are exported: one row a metric.
LIVE_FAMILIES: tuple[Family[_Scrape], ...] = (
    Family(
        "pdscope_proxy_routing_state",
        "1 for the routing state in force: fresh (controller's table), static (last table kept, "
        "controller unreachable), fallback (equal weights), default (no table yet, no poll failed), "
        "never_reached (no controller answered since start: equal weights), advisory.",
        "gauge",
        ("state",),
        lambda s: [((st,), 1.0 if s.src.routing.state == st else 0.0) for st in STATES],
    ),
    Family(
        "pdscope_proxy_routing_table_version",
        "Version of the table in force (-1: none).",
        "gauge",
        (),
        lambda s: one(float(-1 if s.src.routing.view.version is None else s.src.routing.view.version)),
    ),
    Family(
        "pdscope_proxy_routing_table_age_seconds",
        "Seconds since the last good poll (-1: never).",
        "gauge",
        (),
        _table_age,
    ),
    Family(
        "pdscope_proxy_routing_poll_failures",
        "Failed polls of the routing table.",
        "counter",
        (),
        lambda s: one(float(s.src.routing.poll_failures)),
    ),
    Family(
        "pdscope_proxy_pool_inflight_requests",
        "Admitted requests per pool.",
        "gauge",
        _POOL,
        lambda s: by_key(s.src.admission.requests.items()),
    ),
    Family(
        "pdscope_proxy_pool_inflight_kv_bytes",
        "Handoff KV bytes in flight per pool.",
        "gauge",
        _POOL,
        lambda s: by_key(s.src.admission.kv_bytes.items()),
    ),
    Family(
        "pdscope_proxy_pool_demand",
        "Requests that sought admission into each pool (admitted or not): what the controller "
        "splits the pools' limits among proxies by.",
        "counter",
        _POOL,
        lambda s: by_key(s.src.admission.demand.items()),
    ),
    Family(
        "pdscope_proxy_pool_limit",
        "The limits this proxy enforces per pool (its part of the pool's, or the config's "
        "divided by proxy.expected_replicas), kind requests or kv_bytes.",
        "gauge",
        ("pool", "kind"),
        _pool_limits,
    ),
    Family(
        "pdscope_proxy_limit_share",
        "This proxy's fraction of each pool's limits as the controller last gave it "
        "(absent: no part, the config's limits divided by proxy.expected_replicas apply).",
        "gauge",
        _POOL,
        lambda s: by_key(
            (pool, part.share) for pool, part in ({} if s.share is None else s.share.pools).items()
        ),
    ),
    Family(
        "pdscope_proxy_live_proxies",
        "Live proxies the controller split the limits among at this proxy's last part (0: none).",
        "gauge",
        (),
        lambda s: one(0.0 if s.share is None else float(s.share.live)),
    ),
    Family(
        "pdscope_proxy_admission_waiting",
        "Requests waiting for admission.",
        "gauge",
        (),
        lambda s: one(float(s.src.admission.waiting)),
    ),
    Family(
        "pdscope_proxy_instance_inflight",
        "In-flight upstream calls per instance.",
        "gauge",
        _INSTANCE,
        lambda s: by_key(s.src.selector.inflight.items()),
    ),
    Family(
        "pdscope_proxy_outlier_ejections",
        "Outlier ejections by instance and reason (consecutive_failures, "
        "failure_ratio, probation: the first failure after a return).",
        "counter",
        ("instance", "reason"),
        lambda s: [(pair, float(n)) for pair, n in sorted(s.src.selector.outliers.ejections.items())],
    ),
    Family(
        "pdscope_proxy_instance_ejected",
        "1 while outlier detection keeps the instance out of selection.",
        "gauge",
        _INSTANCE,
        _ejected,
    ),
    Family(
        "pdscope_proxy_pool_adaptive_limit",
        "Requests a pool admits now: its adaptive limit (AIMD on the "
        "proxy's own TTFT), never above the limit in force.",
        "gauge",
        _POOL,
        _adaptive_limits,
    ),
    Family(
        "pdscope_proxy_retry_budget_balance",
        "Retries the budget allows now.",
        "gauge",
        (),
        lambda s: one(s.src.budget.balance),
    ),
    Family(
        "pdscope_proxy_spans_dropped",
        "Spans lost because the queue or the buffer of unsampled traces' children was "
        "full (or still there at shutdown).",
        "counter",
        (),
        _spans(lambda p: p.dropped),
    ),
    Family(
        "pdscope_proxy_spans_unsampled",
        "Child spans not exported by sampling (proxy.trace_sample_ratio): their trace was "
        "not sampled, did not fail and met the TTFT SLO.",
        "counter",
        (),
        _spans(lambda p: p.unsampled),
    ),
    Family(
        "pdscope_proxy_spans_exported",
        "Spans the collector accepted.",
        "counter",
        (),
        _spans(lambda p: p.exported),
    ),
    Family(
        "pdscope_proxy_spans_export_failed",
        "Spans in failed export tries (a batch retried n times counts n times).",
        "counter",
        (),
        _spans(lambda p: p.failed),
    ),
    Family(
        "pdscope_proxy_spans_rejected",
        "Spans in batches the collector refused for good (4xx other than 408/429): lost.",
        "counter",
        (),
        _spans(lambda p: p.rejected),
    ),
    Family(
        "pdscope_proxy_spans_export_retries",
        "Retried tries of a held span batch.",
        "counter",
        (),
        _spans(lambda p: p.retries),
    ),
    Family(
        "pdscope_proxy_spans_queued", "Spans waiting to be exported.", "gauge", (), _spans(lambda p: p.queued)
    ),
    Family(
        "pdscope_proxy_kv_events_messages",
        "KV event messages decoded, per instance.",
        "counter",
        _INSTANCE,
        _kv_count(lambda c: c.messages),
    ),
    Family(
        "pdscope_proxy_kv_events_gaps",
        "Gaps in an instance's event sequence (messages lost: replayed, or its view rebuilt).",
        "counter",
        _INSTANCE,
        _kv_count(lambda c: c.gaps),
    ),
    Family(
        "pdscope_proxy_kv_events_restarts",
        "Publishers that restarted their sequence (a restarted instance: its view is forgotten).",
        "counter",
        _INSTANCE,
        _kv_count(lambda c: c.restarts),
    ),
    Family(
        "pdscope_proxy_kv_events_skipped_events",
        "Events of a kind pdscope does not know, skipped inside decoded messages.",
        "counter",
        _INSTANCE,
        _kv_count(lambda c: c.skipped_events),
    ),
    Family(
        "pdscope_proxy_kv_events_rebuilds",
        "Times an instance's view was forgotten to be rebuilt from its next events.",
        "counter",
        _INSTANCE,
        _kv_count(lambda c: c.rebuilds),
    ),
    Family(
        "pdscope_proxy_kv_events_dropped",
        "KV event messages dropped, per instance and reason (undecodable, duplicate, unknown_instance, ...).",
        "counter",
        ("instance", "reason"),
        _kv_pairs(lambda c: c.dropped),
    ),
    Family(
        "pdscope_proxy_kv_events_replays",
        "Replays asked of an instance's replay socket after a gap, by outcome (ok, failed).",
        "counter",
        ("instance", "outcome"),
        _kv_pairs(lambda c: c.replays),
    ),
    Family(
        "pdscope_proxy_kv_events_loop_errors",
        "Failures of the subscriber's loop (logged; it went on).",
        "counter",
        (),
        lambda s: None if s.src.kv_events is None else one(float(s.src.kv_events.counts.loop_errors)),
    ),
    Family(
        "pdscope_proxy_kv_events_last_message_age_seconds",
        "Seconds since the instance's last KV event message (-1: none yet). An idle instance publishes "
        "nothing: read it with the instance's traffic.",
        "gauge",
        _INSTANCE,
        _kv_age,
    ),
    Family(
        "pdscope_proxy_kv_index_blocks",
        "KV blocks the prefix index holds for the instance.",
        "gauge",
        _INSTANCE,
        _kv_index(lambda index: index[0]),
    ),
    Family(
        "pdscope_proxy_kv_index_stale",
        "1 while the instance's view is stale (credited nothing until rebuilt).",
        "gauge",
        _INSTANCE,
        _kv_index(lambda index: index[1]),
    ),
    Family(
        "pdscope_proxy_kv_hit_checks",
        "KV-aware routing's predictions checked against the cached tokens the instance reported, "
        "per instance and verdict: hit, miss (less than half came true), distrusted (precise mode: its "
        "events no longer credited, see docs/trust.md), trusted (credited again after probation).",
        "counter",
        ("instance", "verdict"),
        _hit_checks,
    ),
    Family(
        "pdscope_proxy_kv_checked_cached_tokens",
        "The checked predictions' cached prompt tokens, per instance and figure: predicted (what the "
        "cache view credited the chosen instance) and reported (what vLLM said it reused, up to the "
        "prediction). reported / predicted: the share of the view's predictions that came true.",
        "counter",
        ("instance", "figure"),
        _checked_tokens,
    ),
)


class _LiveCollector(Collector):
    def __init__(self, sources: LiveSources) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        return families(LIVE_FAMILIES, _Scrape(self.sources))
