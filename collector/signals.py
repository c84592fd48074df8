"""Which vLLM series pdscope stores, and how a parsed page becomes one snapshot's values.

``SPECS`` is the single table of what the collector keeps: each entry names a vLLM family
(as the 0.0.4 text from prometheus_client spells its ``# TYPE`` line) and the
``store.models.Snapshot`` column(s) it fills. Values are summed over the ``engine`` label
(data-parallel engines), except ``kv_cache_usage``, which is the mean. Histograms keep
their sum and count in columns and their cumulative buckets in ``Snapshot.histograms``.
Any other ``vllm:nixl_*`` series (a newer vLLM) is summed into ``extra``.

``from_page`` is the reference extraction over the general parser's output; the hot
path (``collector.fastparse``) must produce the same ``Signals`` for the same text. This
module does no I/O and knows nothing about the store's session or the scraper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from collector.parse import ParsedPage, parse_text

Kind = Literal["scalar", "labelled", "histogram"]


@dataclass(frozen=True)
class Spec:
    family: str
    kind: Kind
    column: str | None = None  # scalar: the column; histogram: prefix of <prefix>_sum/_count
    label: str | None = None  # labelled: the label that picks the column
    columns: tuple[tuple[str, str], ...] = ()  # labelled: (label value, column)
    mean: bool = False  # gauges that are a fraction per engine
    buckets: bool = False  # histogram: keep cumulative buckets in Snapshot.histograms


def _hist(family: str, prefix: str | None, buckets: bool = True) -> Spec:
    return Spec(family, "histogram", column=prefix, buckets=buckets)


SPECS: tuple[Spec, ...] = (
    Spec("vllm:kv_cache_usage_perc", "scalar", "kv_cache_usage", mean=True),
    Spec("vllm:num_requests_running", "scalar", "num_running"),
    Spec("vllm:num_requests_waiting", "scalar", "num_waiting"),
    Spec(
        "vllm:num_requests_waiting_by_reason",
        "labelled",
        label="reason",
        columns=(("capacity", "waiting_capacity"), ("deferred", "waiting_deferred")),
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
    ),
    Spec("vllm:prompt_tokens_total", "scalar", "prompt_tokens"),
    Spec("vllm:generation_tokens_total", "scalar", "generation_tokens"),
    Spec(
        "vllm:prompt_tokens_by_source_total",
        "labelled",
        label="source",
        columns=(
            ("local_compute", "prompt_tokens_local_compute"),
            ("local_cache_hit", "prompt_tokens_local_cache_hit"),
            ("external_kv_transfer", "prompt_tokens_external_kv_transfer"),
        ),
    ),
    Spec("vllm:prompt_tokens_cached_total", "scalar", "prompt_tokens_cached"),
    Spec("vllm:prefix_cache_queries_total", "scalar", "prefix_cache_queries"),
    Spec("vllm:prefix_cache_hits_total", "scalar", "prefix_cache_hits"),
    Spec("vllm:external_prefix_cache_queries_total", "scalar", "external_prefix_cache_queries"),
    Spec("vllm:external_prefix_cache_hits_total", "scalar", "external_prefix_cache_hits"),
    Spec("vllm:num_preemptions_total", "scalar", "preemptions"),
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
    ),
    Spec(
        "vllm:admission_rejections_total",
        "labelled",
        label="reason",
        columns=(
            ("max_num_queued_reqs", "admission_rejections_reqs"),
            ("max_num_queued_tokens", "admission_rejections_tokens"),
        ),
    ),
    _hist("vllm:time_to_first_token_seconds", "ttft"),
    _hist("vllm:inter_token_latency_seconds", "itl"),
    _hist("vllm:e2e_request_latency_seconds", "e2e"),
    _hist("vllm:request_queue_time_seconds", "queue"),
    _hist("vllm:request_prefill_time_seconds", None),
    _hist("vllm:request_decode_time_seconds", None),
    _hist("vllm:request_inference_time_seconds", None),
    _hist("vllm:request_time_per_output_token_seconds", None),
    _hist("vllm:request_prompt_tokens", None),
    _hist("vllm:request_generation_tokens", None),
    _hist("vllm:nixl_xfer_time_seconds", "nixl_xfer_time"),
    _hist("vllm:nixl_post_time_seconds", "nixl_post_time"),
    _hist("vllm:nixl_bytes_transferred", "nixl_bytes"),
    _hist("vllm:nixl_num_descriptors", "nixl_descriptors"),
    Spec("vllm:nixl_num_failed_transfers_total", "scalar", "nixl_failed_transfers"),
    Spec("vllm:nixl_num_failed_notifications_total", "scalar", "nixl_failed_notifications"),
    Spec("vllm:nixl_num_kv_expired_reqs_total", "scalar", "nixl_kv_expired_reqs"),
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
NIXL_PREFIX = "vllm:nixl_"
COUNTER_COLUMNS: tuple[str, ...] = tuple(
    [s.column for s in SPECS if s.kind == "scalar" and s.family.endswith("_total") and s.column]
    + [c for s in SPECS if s.kind == "labelled" and s.family.endswith("_total") for _, c in s.columns]
    + [f"{s.column}_{k}" for s in SPECS if s.kind == "histogram" and s.column for k in ("sum", "count")]
)


@dataclass
class Signals:
    """What one page yields for one snapshot row. ``values`` maps Snapshot columns to floats."""

    values: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, dict[str, Any]] = field(default_factory=dict)
    extra: dict[str, float] = field(default_factory=dict)
    engines: int | None = None
    process_start_ts: float | None = None
    errors: list[str] = field(default_factory=list)


def openmetrics_name(family: str, mtype: str) -> str:
    """The 0.0.4 name of a family: OpenMetrics names a counter ``foo``, its samples ``foo_total``."""
    if mtype == "counter" and not family.endswith("_total"):
        return family + "_total"
    return family


class HistogramAcc:
    """Cumulative buckets summed over engines; ``result`` gives the JSON-safe shape."""

    __slots__ = ("buckets", "count", "inf", "sum")

    def __init__(self) -> None:
        self.buckets: dict[float, float] = {}
        self.inf: float | None = None
        self.sum: float | None = None
        self.count: float | None = None

    def add_bucket(self, le: float, value: float) -> None:
        if le == math.inf:
            self.inf = value if self.inf is None else self.inf + value
        else:
            self.buckets[le] = self.buckets.get(le, 0.0) + value

    def add_sum(self, value: float) -> None:
        self.sum = value if self.sum is None else self.sum + value

    def add_count(self, value: float) -> None:
        self.count = value if self.count is None else self.count + value

    def result(self, family: str, errors: list[str]) -> dict[str, Any] | None:
        bounds = sorted(self.buckets)
        counts = [self.buckets[b] for b in bounds]
        inf = self.inf if self.inf is not None else self.count
        if inf is None:
            return None
        counts.append(inf)
        numbers = [*bounds, *counts, self.sum if self.sum is not None else 0.0]
        if not math.isfinite(sum(numbers)):  # one NaN or Inf makes the sum non-finite
            errors.append(f"{family}: non-finite bucket, sum or count; histogram dropped")
            return None
        return {"le": bounds, "counts": counts, "sum": self.sum or 0.0, "count": self.count if self.count is not None else inf}


def finish(
    signals: Signals,
    scalars: dict[str, list[float]],
    hists: dict[str, HistogramAcc],
) -> Signals:
    """Fold per-engine values into columns; shared by both extraction paths."""
    for spec_family, acc in hists.items():
        spec = SPEC_BY_FAMILY.get(spec_family)
        shape = acc.result(spec_family, signals.errors)
        if shape is None:
            continue
        if spec is None:  # an unknown nixl histogram
            signals.extra[spec_family + "_sum"] = shape["sum"]
            signals.extra[spec_family + "_count"] = shape["count"]
            continue
        if spec.column:
            signals.values[spec.column + "_sum"] = shape["sum"]
            signals.values[spec.column + "_count"] = shape["count"]
        if spec.buckets:
            signals.histograms[spec_family] = shape
    for column, vals in scalars.items():
        if not math.isfinite(sum(vals)):
            signals.errors.append(f"{column}: non-finite value; not stored")
            continue
        if column.startswith(NIXL_PREFIX):
            signals.extra[column] = sum(vals)
        elif column == "kv_cache_usage":
            signals.values[column] = sum(vals) / len(vals)
        else:
            signals.values[column] = sum(vals)
    return signals


def from_page(page: ParsedPage) -> Signals:
    """Extract the stored signals from a fully parsed page (the reference path)."""
    signals = Signals(errors=list(page.errors))
    scalars: dict[str, list[float]] = {}
    hists: dict[str, HistogramAcc] = {}
    present = {openmetrics_name(name, fam.type) for name, fam in page.families.items()}
    engines: set[str] = set()
    for name, fam in page.families.items():
        family = openmetrics_name(name, fam.type)
        if family in ALIASES and ALIASES[family] not in present:
            family = ALIASES[family]
        spec = SPEC_BY_FAMILY.get(family)
        if family == PROCESS_START and fam.samples:
            signals.process_start_ts = fam.samples[0].value
            continue
        if spec is None:
            if family.startswith(NIXL_PREFIX) and not family.endswith("_created"):
                spec = Spec(family, "histogram" if fam.type == "histogram" else "scalar", column=family)
            else:
                continue
        if family == ENGINE_FAMILY:
            engines.update(s.labels.get("engine", "") for s in fam.samples)
        columns = dict(spec.columns)
        for s in fam.samples:
            if spec.kind == "scalar":
                if s.name.endswith("_created"):
                    continue
                scalars.setdefault(spec.column or family, []).append(s.value)
            elif spec.kind == "labelled":
                if s.name.endswith("_created"):
                    continue
                col = columns.get(s.labels.get(spec.label or "", ""))
                if col is not None:
                    scalars.setdefault(col, []).append(s.value)
            else:
                acc = hists.setdefault(family, HistogramAcc())
                if s.name.endswith("_bucket"):
                    try:
                        acc.add_bucket(float(s.labels.get("le", "")), s.value)
                    except ValueError:
                        signals.errors.append(f"{family}: bad le {s.labels.get('le')!r}")
                elif s.name.endswith("_sum"):
                    acc.add_sum(s.value)
                elif s.name.endswith("_count"):
                    acc.add_count(s.value)
    if engines:
        signals.engines = len(engines)
    return finish(signals, scalars, hists)


def from_text(text: str | bytes) -> Signals:
    return from_page(parse_text(text))
