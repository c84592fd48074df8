"""The collector's own Prometheus metrics: per-target up, last error, scrape duration, span flow.

One ``CollectorMetrics`` per collector process, on its own ``CollectorRegistry`` (never
the global one), served at ``/metrics`` by the receiver app.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from collector.scraper import ScrapeResult
from collector.spool import Spool
from collector.targets import ScrapeTarget


class CollectorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.up = Gauge(
            "pdscope_collector_target_up",
            "1 if the last scrape of the target succeeded",
            ["instance", "pool", "role"],
            registry=r,
        )
        self.duration = Gauge(
            "pdscope_collector_scrape_duration_seconds",
            "Duration of the last scrape of the target",
            ["instance"],
            registry=r,
        )
        self.last_error = Gauge(
            "pdscope_collector_target_last_error",
            "1 with the last scrape error of the target as a label; absent when the last scrape succeeded",
            ["instance", "error"],
            registry=r,
        )
        self.scrapes = Counter(
            "pdscope_collector_scrapes", "Scrapes by result", ["instance", "result"], registry=r
        )
        self.body_bytes = Gauge(
            "pdscope_collector_scrape_body_bytes", "Size of the last page", ["instance"], registry=r
        )
        self.parse_errors = Counter(
            "pdscope_collector_parse_errors",
            "Malformed lines or values reported by the parser",
            ["instance"],
            registry=r,
        )
        self.resets = Counter(
            "pdscope_collector_counter_resets",
            "Instance restarts seen as counter resets",
            ["instance"],
            registry=r,
        )
        self.store_errors = Counter(
            "pdscope_collector_store_errors", "Failed writes to the store", ["what"], registry=r
        )
        self.snapshots = Counter("pdscope_collector_snapshots_written", "Snapshot rows written", registry=r)
        self.otlp_requests = Counter(
            "pdscope_collector_otlp_requests", "OTLP export requests by result", ["result"], registry=r
        )
        self.spans_received = Counter(
            "pdscope_collector_spans_received", "Spans accepted into the queue", registry=r
        )
        self.spans_dropped = Counter(
            "pdscope_collector_spans_dropped", "Spans dropped", ["reason"], registry=r
        )
        self.spans_written = Counter(
            "pdscope_collector_spans_written", "Spans written to the store", registry=r
        )
        self.records = Counter(
            "pdscope_collector_records_assembled", "Request records created or updated", registry=r
        )
        self.queue = Gauge("pdscope_collector_span_queue", "Spans waiting to be written", registry=r)
        self.spans_truncated = Counter(
            "pdscope_collector_spans_truncated",
            "Spans kept with attributes or events cut to the limits",
            registry=r,
        )
        self.records_failed = Counter(
            "pdscope_collector_records_failed",
            "Traces whose request record could not be assembled",
            ["reason"],
            registry=r,
        )
        self.record_attributes_dropped = Counter(
            "pdscope_collector_record_attributes_dropped",
            "Root span attributes left out of request records as invalid (out of range, not hex, unknown)",
            ["attribute"],
            registry=r,
        )
        self.task_errors = Counter(
            "pdscope_collector_task_errors",
            "Failed turns of a background task (caught; the task goes on)",
            ["task", "reason"],
            registry=r,
        )
        self.inflight_bytes = Gauge(
            "pdscope_collector_otlp_inflight_bytes",
            "OTLP body bytes (as sent and inflated) held by requests now",
            registry=r,
        )
        self.owned_targets = Gauge(
            "pdscope_collector_owned_targets",
            "Instances this collector scrapes: its share among the live collectors (all, when alone)",
            registry=r,
        )
        self.live_collectors = Gauge(
            "pdscope_collector_live_collectors",
            "Collectors live in the store's membership as this collector last read it (1 when alone)",
            registry=r,
        )
        self.membership_errors = Counter(
            "pdscope_collector_membership_errors",
            "Heartbeats not stored (store, timeout) and ids used by two live processes (duplicate_id)",
            ["reason"],
            registry=r,
        )
        self.spool_refused = Counter(
            "pdscope_collector_spool_refused_spans",
            "Spans of exports answered 503 because the spool was past its bound "
            "(spool_full: bytes or spans; spool_age: its oldest batch) or the disk refused (spool_error)",
            ["reason"],
            registry=r,
        )
        self.spool_replayed = Counter(
            "pdscope_collector_spool_replayed_spans",
            "Spans written to the store after a store outage, or read back from the spool at start up",
            registry=r,
        )
        self.spool_bytes = Gauge(
            "pdscope_collector_spool_bytes",
            "Bytes of span batches in the spool, not yet in the store",
            registry=r,
        )
        self.spool_batches = Gauge(
            "pdscope_collector_spool_batches", "Span batches in the spool, not yet in the store", registry=r
        )
        self.spool_oldest_age = Gauge(
            "pdscope_collector_spool_oldest_age_seconds",
            "Age of the oldest batch in the spool (0 when empty): how long the store has been behind",
            registry=r,
        )
        self.spool_corrupt = Gauge(
            "pdscope_collector_spool_corrupt_records",
            "Spool records (or torn tails) skipped as unreadable since this collector started",
            registry=r,
        )
        self._errors: dict[str, str] = {}

    def watch_spool(self, spool: Spool) -> None:
        """The spool's gauges, read when /metrics is scraped."""
        self.spool_bytes.set_function(lambda: float(spool.pending_bytes))
        self.spool_batches.set_function(lambda: float(spool.batches))
        self.spool_oldest_age.set_function(spool.oldest_age_s)
        self.spool_corrupt.set_function(lambda: float(spool.corrupt))

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
