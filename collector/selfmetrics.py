"""The collector's own Prometheus metrics: per-target up, last error, scrape duration, span flow.

One ``CollectorMetrics`` per collector process, on its own ``CollectorRegistry`` (never
the global one), served at ``/metrics`` by the receiver app. The families are declared once, as
tables: :data:`COLLECTOR_FAMILIES` (the counters and gauges the collector updates, one attribute
each) and :data:`SPOOL_FAMILIES` (the spool's gauges, read from it at scrape time through
:mod:`pdscope.metricfamilies`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from collector.scraper import ScrapeResult
from collector.spool import Spool
from collector.targets import ScrapeTarget
from pdscope.metricfamilies import Family, Samples, families, one

_INSTRUMENTS: dict[str, type[Gauge] | type[Counter]] = {"gauge": Gauge, "counter": Counter}

# The families the collector updates, in the order they are exported: one row a metric,
# (attribute, kind, name, help, labels).
COLLECTOR_FAMILIES: tuple[tuple[str, Literal["gauge", "counter"], str, str, tuple[str, ...]], ...] = (
    (
        "up",
        "gauge",
        "pdscope_collector_target_up",
        "1 if the last scrape of the target succeeded",
        ("instance", "pool", "role"),
    ),
    (
        "duration",
        "gauge",
        "pdscope_collector_scrape_duration_seconds",
        "Duration of the last scrape of the target",
        ("instance",),
    ),
    (
        "last_error",
        "gauge",
        "pdscope_collector_target_last_error",
        "1 with the last scrape error of the target as a label; absent when the last scrape succeeded",
        ("instance", "error"),
    ),
    ("scrapes", "counter", "pdscope_collector_scrapes", "Scrapes by result", ("instance", "result")),
    ("body_bytes", "gauge", "pdscope_collector_scrape_body_bytes", "Size of the last page", ("instance",)),
    (
        "parse_errors",
        "counter",
        "pdscope_collector_parse_errors",
        "Malformed lines or values reported by the parser",
        ("instance",),
    ),
    (
        "resets",
        "counter",
        "pdscope_collector_counter_resets",
        "Instance restarts seen as counter resets",
        ("instance",),
    ),
    ("store_errors", "counter", "pdscope_collector_store_errors", "Failed writes to the store", ("what",)),
    ("snapshots", "counter", "pdscope_collector_snapshots_written", "Snapshot rows written", ()),
    (
        "otlp_requests",
        "counter",
        "pdscope_collector_otlp_requests",
        "OTLP export requests by result",
        ("result",),
    ),
    ("spans_received", "counter", "pdscope_collector_spans_received", "Spans accepted into the queue", ()),
    ("spans_dropped", "counter", "pdscope_collector_spans_dropped", "Spans dropped", ("reason",)),
    ("spans_written", "counter", "pdscope_collector_spans_written", "Spans written to the store", ()),
    ("records", "counter", "pdscope_collector_records_assembled", "Request records created or updated", ()),
    ("queue", "gauge", "pdscope_collector_span_queue", "Spans waiting to be written", ()),
    (
        "spans_truncated",
        "counter",
        "pdscope_collector_spans_truncated",
        "Spans kept with attributes or events cut to the limits",
        (),
    ),
    (
        "records_failed",
        "counter",
        "pdscope_collector_records_failed",
        "Traces whose request record could not be assembled",
        ("reason",),
    ),
    (
        "record_attributes_dropped",
        "counter",
        "pdscope_collector_record_attributes_dropped",
        "Root span attributes left out of request records as invalid (out of range, not hex, unknown)",
        ("attribute",),
    ),
    (
        "task_errors",
        "counter",
        "pdscope_collector_task_errors",
        "Failed turns of a background task (caught; the task goes on)",
        ("task", "reason"),
    ),
    (
        "inflight_bytes",
        "gauge",
        "pdscope_collector_otlp_inflight_bytes",
        "OTLP body bytes (as sent and inflated) held by requests now",
        (),
    ),
    (
        "owned_targets",
        "gauge",
        "pdscope_collector_owned_targets",
        "Instances this collector scrapes: its share among the live collectors (all, when alone)",
        (),
    ),
    (
        "live_collectors",
        "gauge",
        "pdscope_collector_live_collectors",
        "Collectors live in the store's membership as this collector last read it (1 when alone)",
        (),
    ),
    (
        "membership_errors",
        "counter",
        "pdscope_collector_membership_errors",
        "Heartbeats not stored (store, timeout) and ids used by two live processes (duplicate_id)",
        ("reason",),
    ),
    (
        "spool_refused",
        "counter",
        "pdscope_collector_spool_refused_spans",
        "Spans of exports answered 503 because the spool was past its bound "
        "(spool_full: bytes or spans; spool_age: its oldest batch) or the disk refused (spool_error)",
        ("reason",),
    ),
    (
        "spool_replayed",
        "counter",
        "pdscope_collector_spool_replayed_spans",
        "Spans written to the store after a store outage, or read back from the spool at start up",
        (),
    ),
)


def _spool(read: Callable[[Spool], float]) -> Callable[[Spool | None], Samples]:
    """A figure of the spool's, 0 until the collector watches one."""
    return lambda spool: one(0.0 if spool is None else read(spool))


# The spool's gauges, exported after the collector's families, read from the spool at scrape time.
SPOOL_FAMILIES: tuple[Family[Spool | None], ...] = (
    Family(
        "pdscope_collector_spool_bytes",
        "Bytes of span batches in the spool, not yet in the store",
        "gauge",
        (),
        _spool(lambda s: float(s.pending_bytes)),
    ),
    Family(
        "pdscope_collector_spool_batches",
        "Span batches in the spool, not yet in the store",
        "gauge",
        (),
        _spool(lambda s: float(s.batches)),
    ),
    Family(
        "pdscope_collector_spool_oldest_age_seconds",
        "Age of the oldest batch in the spool (0 when empty): how long the store has been behind",
        "gauge",
        (),
        _spool(lambda s: s.oldest_age_s()),
    ),
    Family(
        "pdscope_collector_spool_corrupt_records",
        "Spool records (or torn tails) skipped as unreadable since this collector started",
        "gauge",
        (),
        _spool(lambda s: float(s.corrupt)),
    ),
)


class _SpoolCollector(Collector):
    """The spool's gauges, read when /metrics is scraped (0 before :meth:`CollectorMetrics.watch_spool`)."""

    def __init__(self) -> None:
        self.spool: Spool | None = None

    def collect(self) -> Iterator[Metric]:
        return families(SPOOL_FAMILIES, self.spool)


class CollectorMetrics:
    # the attributes COLLECTOR_FAMILIES declares
    up: Gauge
    duration: Gauge
    last_error: Gauge
    scrapes: Counter
    body_bytes: Gauge
    parse_errors: Counter
    resets: Counter
    store_errors: Counter
    snapshots: Counter
    otlp_requests: Counter
    spans_received: Counter
    spans_dropped: Counter
    spans_written: Counter
    records: Counter
    queue: Gauge
    spans_truncated: Counter
    records_failed: Counter
    record_attributes_dropped: Counter
    task_errors: Counter
    inflight_bytes: Gauge
    owned_targets: Gauge
    live_collectors: Gauge
    membership_errors: Counter
    spool_refused: Counter
    spool_replayed: Counter

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        for attr, kind, name, help_, labels in COLLECTOR_FAMILIES:
            setattr(self, attr, _INSTRUMENTS[kind](name, help_, labels, registry=self.registry))
        self._spool = _SpoolCollector()
        self.registry.register(self._spool)
        self._errors: dict[str, str] = {}

    def watch_spool(self, spool: Spool) -> None:
        """The spool's gauges, read when /metrics is scraped."""
        self._spool.spool = spool

    def observe_round(self, results: Sequence[ScrapeResult]) -> None:
        for res in results:
            t = res.target
            self.up.labels(t.name, t.pool, t.role).set(1.0 if res.up else 0.0)
            self.duration.labels(t.name).set(res.duration_s)
            self.body_bytes.labels(t.name).set(res.body_bytes)
            self.scrapes.labels(t.name, "ok" if res.up else "error").inc()
            if res.signals is not None and res.signals.errors:
                self.parse_errors.labels(t.name).inc(len(res.signals.errors))
            old = self._errors.pop(t.name, None)
            if old is not None:
                self.last_error.remove(t.name, old)
            if res.error is not None:
                err = res.error[:200]
                self._errors[t.name] = err
                self.last_error.labels(t.name, err).set(1.0)

    def forget(self, targets: Sequence[ScrapeTarget]) -> None:
        """Drop the per-target gauges of instances another collector now scrapes (its figures win)."""
        for t in targets:
            for gauge, labels in (
                (self.up, (t.name, t.pool, t.role)),
                (self.duration, (t.name,)),
                (self.body_bytes, (t.name,)),
            ):
                try:
                    gauge.remove(*labels)
                except KeyError:
                    pass
            old = self._errors.pop(t.name, None)
            if old is not None:
                self.last_error.remove(t.name, old)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
