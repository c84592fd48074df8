"""The vLLM metric families pdscope stores, and the ``Snapshot`` columns each one fills.

``SPECS`` is the one table of what the collector keeps of a vLLM ``/metrics`` page. Every
list of columns elsewhere is derived from it: the collector's extraction
(``collector.signals``, ``collector.fastparse``, ``collector.promsource``) reads exactly
these families; its minute rollups (``collector.retention``) roll up
:data:`COUNTER_COLUMNS` and :data:`GAUGE_COLUMNS`; its reset watch
(``collector.snapshot_store``) watches :data:`RESET_WATCH`; and the store's window
queries (``store.queries``) read :data:`WINDOW_COUNTERS` and :data:`WINDOW_GAUGES`.

Each entry names a family as the 0.0.4 text from prometheus_client spells its ``# TYPE``
line, and its column(s): a ``scalar`` fills one column; a ``labelled`` family one column
per value of one label; a ``histogram`` its ``<column>_sum`` / ``<column>_count`` columns
(when it has a column prefix) and, with ``buckets``, its cumulative buckets in
``Snapshot.histograms`` under the family's name. Values are summed over the ``engine``
label (data-parallel engines), except ``mean`` families (a fraction per engine). A family
whose name ends in ``_total``, and a histogram's sum and count, are counters; the other
columns are gauges. ``window`` names the columns the store's window queries read from every
snapshot (counters become increases, gauges their latest value); ``watch`` the counters
whose drop marks an instance restart. Any other ``vllm:nixl_*`` series (a newer vLLM) is
summed into ``Snapshot.extra``.

How to add a metric:

1. Add its column(s) to ``store.models.Snapshot`` and a migration in ``migrations/versions``
   (``alembic revision --autogenerate``; the tests run ``alembic check``).
2. Add (or extend) its row in ``SPECS`` below: family, kind, column(s); ``window=`` if the
   store's window queries (and so the controller) should read it, ``watch=`` if its drop
   should count as a restart. The extraction, the rollups, the reset watch and the window
   queries follow from the table.
3. What remains is whoever uses it: a rate or field on ``store.queries.ScrapeFigures``,
   the columns a dashboard page selects (``dashboard/queries/``), the simulator's own
   ``/metrics`` (``simulator/metrics.py``) if the simulated fleet should emit it.

This module is data and pure helpers: no I/O, no session, nothing from the services.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pdscope.stats import Histogram

Kind = Literal["scalar", "labelled", "histogram"]

# Histogram families kept in Snapshot.histograms (the vLLM names).
HIST_TTFT = "vllm:time_to_first_token_seconds"
HIST_ITL = "vllm:inter_token_latency_seconds"
HIST_TPOT = "vllm:request_time_per_output_token_seconds"
HIST_E2E = "vllm:e2e_request_latency_seconds"
HIST_QUEUE = "vllm:request_queue_time_seconds"
HIST_PREFILL = "vllm:request_prefill_time_seconds"
HIST_DECODE = "vllm:request_decode_time_seconds"
HIST_INFERENCE = "vllm:request_inference_time_seconds"
HIST_NIXL_XFER = "vllm:nixl_xfer_time_seconds"
HIST_NIXL_POST = "vllm:nixl_post_time_seconds"
HIST_NIXL_BYTES = "vllm:nixl_bytes_transferred"
HIST_NIXL_DESCRIPTORS = "vllm:nixl_num_descriptors"


@dataclass(frozen=True)
class Spec:
    """One stored vLLM family. Construction raises ``ValueError`` when ``window`` or
    ``watch`` names a column the family does not fill, or ``watch`` a gauge."""

    family: str
    kind: Kind
    column: str | None = None  # scalar: the column; histogram: prefix of <prefix>_sum/_count
    label: str | None = None  # labelled: the label that picks the column
    columns: tuple[tuple[str, str], ...] = ()  # labelled: (label value, column)
    mean: bool = False  # gauges that are a fraction per engine
    buckets: bool = False  # histogram: keep cumulative buckets in Snapshot.histograms
    window: tuple[str, ...] = ()  # columns the store's window queries read
    watch: tuple[str, ...] = ()  # counter columns whose drop marks a restart

    def __post_init__(self) -> None:
        stored = set(self.stored_columns)
        for name, cols in (("window", self.window), ("watch", self.watch)):
            if not set(cols) <= stored:
                raise ValueError(
                    f"{self.family}: {name} names {sorted(set(cols) - stored)}, "
                    f"not among its columns {sorted(stored)}"
                )
        if self.watch and not self.counter:
            raise ValueError(f"{self.family}: only counters can be watched for resets")

    @property
    def counter(self) -> bool:
        """Are this family's columns counters (cumulative) rather than gauges?"""
        return self.kind == "histogram" or self.family.endswith("_total")

    @property
    def stored_columns(self) -> tuple[str, ...]:
        """The ``Snapshot`` columns this family fills (its buckets live in ``histograms``)."""
        if self.kind == "scalar":
            return (self.column,) if self.column else ()
        if self.kind == "labelled":
            return tuple(c for _, c in self.columns)
        return (f"{self.column}_sum", f"{self.column}_count") if self.column else ()


def _hist(
    family: str, prefix: str | None, *, window: tuple[str, ...] = (), watch: tuple[str, ...] = ()
) -> Spec:
    return Spec(family, "histogram", column=prefix, buckets=True, window=window, watch=watch)


SPECS: tuple[Spec, ...] = (
    Spec("vllm:kv_cache_usage_perc", "scalar", "kv_cache_usage", mean=True, window=("kv_cache_usage",)),
    Spec("vllm:num_requests_running", "scalar", "num_running", window=("num_running",)),
    Spec("vllm:num_requests_waiting", "scalar", "num_waiting", window=("num_waiting",)),
    Spec(
        "vllm:num_requests_waiting_by_reason",
        "labelled",
        label="reason",
        columns=(("capacity", "waiting_capacity"), ("deferred", "waiting_deferred")),
        window=("waiting_deferred",),
    ),
    Spec(
        "vllm:num_requests_kv_fetch_by_stage",
        "labelled",
        label="stage",
        columns=(
            ("waiting_to_start", "kv_fetch_waiting_to_start"),
            ("in_progress", "kv_fetch_in_progress"),
            ("completed_waiting", "kv_fetch_completed_waiting"),
        ),
        window=("kv_fetch_waiting_to_start", "kv_fetch_in_progress", "kv_fetch_completed_waiting"),
    ),
    Spec(
        "vllm:prompt_tokens_total",
        "scalar",
        "prompt_tokens",
        window=("prompt_tokens",),
        watch=("prompt_tokens",),
    ),
    Spec(
        "vllm:generation_tokens_total",
        "scalar",
        "generation_tokens",
        window=("generation_tokens",),
        watch=("generation_tokens",),
    ),
    Spec(
        "vllm:prompt_tokens_by_source_total",
        "labelled",
        label="source",
        columns=(
            ("local_compute", "prompt_tokens_local_compute"),
            ("local_cache_hit", "prompt_tokens_local_cache_hit"),
            ("external_kv_transfer", "prompt_tokens_external_kv_transfer"),
        ),
        window=("prompt_tokens_external_kv_transfer",),
    ),
    Spec("vllm:prompt_tokens_cached_total", "scalar", "prompt_tokens_cached"),
    Spec("vllm:prefix_cache_queries_total", "scalar", "prefix_cache_queries"),
    Spec("vllm:prefix_cache_hits_total", "scalar", "prefix_cache_hits"),
    Spec("vllm:external_prefix_cache_queries_total", "scalar", "external_prefix_cache_queries"),
    Spec("vllm:external_prefix_cache_hits_total", "scalar", "external_prefix_cache_hits"),
    Spec("vllm:num_preemptions_total", "scalar", "preemptions", window=("preemptions",)),
    Spec(
        "vllm:request_success_total",
        "labelled",
        label="finished_reason",
        columns=(
            ("stop", "requests_stop"),
            ("length", "requests_length"),
            ("abort", "requests_abort"),
            ("error", "requests_error"),
            ("repetition", "requests_repetition"),
        ),
        window=(
            "requests_stop",
            "requests_length",
            "requests_abort",
            "requests_error",
            "requests_repetition",
        ),
        watch=("requests_length", "requests_stop"),
    ),
    Spec(
        "vllm:admission_rejections_total",
        "labelled",
        label="reason",
        columns=(
            ("max_num_queued_reqs", "admission_rejections_reqs"),
            ("max_num_queued_tokens", "admission_rejections_tokens"),
        ),
        window=("admission_rejections_reqs", "admission_rejections_tokens"),
    ),
    _hist(HIST_TTFT, "ttft", window=("ttft_sum", "ttft_count")),
    _hist(HIST_ITL, "itl"),
    _hist(HIST_E2E, "e2e"),
    _hist(HIST_QUEUE, "queue", window=("queue_sum", "queue_count")),
    _hist(HIST_PREFILL, None),
    _hist(HIST_DECODE, None),
    _hist(HIST_INFERENCE, None),
    _hist(HIST_TPOT, None),
    _hist("vllm:request_prompt_tokens", None),
    _hist("vllm:request_generation_tokens", None),
    _hist(
        HIST_NIXL_XFER,
        "nixl_xfer_time",
        window=("nixl_xfer_time_sum", "nixl_xfer_time_count"),
        watch=("nixl_xfer_time_count",),
    ),
    _hist(HIST_NIXL_POST, "nixl_post_time"),
    _hist(HIST_NIXL_BYTES, "nixl_bytes", window=("nixl_bytes_sum",)),
    _hist(HIST_NIXL_DESCRIPTORS, "nixl_descriptors"),
    Spec(
        "vllm:nixl_num_failed_transfers_total",
        "scalar",
        "nixl_failed_transfers",
        window=("nixl_failed_transfers",),
    ),
    Spec("vllm:nixl_num_failed_notifications_total", "scalar", "nixl_failed_notifications"),
    Spec(
        "vllm:nixl_num_kv_expired_reqs_total",
        "scalar",
        "nixl_kv_expired_reqs",
        window=("nixl_kv_expired_reqs",),
    ),
    Spec("vllm:nixl_num_notifications_after_expiry_total", "scalar", "nixl_notifications_after_expiry"),
)

SPEC_BY_FAMILY: dict[str, Spec] = {s.family: s for s in SPECS}
# Older vLLM names, used only when the current name is absent from the page.
ALIASES: dict[str, str] = {
    "vllm:gpu_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "vllm:gpu_prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_hits_total": "vllm:prefix_cache_hits_total",
    "vllm:time_per_output_token_seconds": "vllm:inter_token_latency_seconds",
}
PROCESS_START = "process_start_time_seconds"
ENGINE_FAMILY = "vllm:num_requests_running"  # registered for every engine, always
CACHE_CONFIG = "vllm:cache_config_info"  # its block_size and cache_dtype labels: a pair must agree on them
NIXL_PREFIX = "vllm:nixl_"

# Scalar counters, then labelled ones, then histogram sums and counts (the rollups' order).
COUNTER_COLUMNS: tuple[str, ...] = tuple(
    c
    for kind in ("scalar", "labelled", "histogram")
    for s in SPECS
    if s.kind == kind and s.counter
    for c in s.stored_columns
)
GAUGE_COLUMNS: tuple[str, ...] = tuple(c for s in SPECS if not s.counter for c in s.stored_columns)
WINDOW_COUNTERS: tuple[str, ...] = tuple(c for s in SPECS if s.counter for c in s.window)
WINDOW_GAUGES: tuple[str, ...] = tuple(c for s in SPECS if not s.counter for c in s.window)
RESET_WATCH: tuple[str, ...] = tuple(c for s in SPECS for c in s.watch)
# Every column of vLLM's NIXL families (the dashboard's KV-transfer reads)
NIXL_COLUMNS: tuple[str, ...] = tuple(
    c for s in SPECS if s.family.startswith(NIXL_PREFIX) for c in s.stored_columns
)
# A histogram by its column prefix ("ttft", "nixl_xfer_time"...): the families that have one.
HISTOGRAM_BY_PREFIX: dict[str, str] = {
    s.column: s.family for s in SPECS if s.kind == "histogram" and s.column
}


def histogram_of(shape: Mapping[str, Any]) -> Histogram:
    """A ``Snapshot.histograms`` entry (``{"le", "counts", "sum", "count"}``) as a
    :class:`pdscope.stats.Histogram`. Raises ``ValueError`` (or ``KeyError``) for a malformed one."""
    return Histogram(tuple(shape["le"]), tuple(shape["counts"]), shape["sum"], shape["count"])


def shape_of(h: Histogram) -> dict[str, Any]:
    """The ``Snapshot.histograms`` entry (JSON-safe: +Inf implied by the extra count) of ``h``."""
    return {"le": list(h.le), "counts": list(h.counts), "sum": h.sum, "count": h.count}
