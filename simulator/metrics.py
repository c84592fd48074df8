"""An instance's ``/metrics``: the same families as real vLLM 0.32/0.33 with NIXL.

Names, types, HELP text, label names and bucket bounds are copied from vLLM (checked
against the real captures in tests/simulator/test_metrics_conformance.py); the text is
rendered by prometheus_client, as vLLM's is, so label order, float formatting and the
``_created`` samples match. Values follow the engine's events (``VllmMetrics`` is the
engine's ``EngineObserver``); gauges are read from the engine when scraped. One registry
per simulated instance; a restarted instance gets a fresh one, as a restarted vLLM does, with
its own ``process_start_time_seconds`` (the time it was built: the simulated fleet is one process).
This module must not model anything: it only records what the engine reports.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Summary,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdscope.simconfig import SimulatorConfig
from pdscope.vllmapi import ITL_BUCKETS, NIXL_XFER_BUCKETS, TTFT_BUCKETS
from simulator.model import FINISH_REASONS, STAGES, SimRequest, Transfer

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

REQUEST_LATENCY = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
TTFT = list(TTFT_BUCKETS)
ITL = list(ITL_BUCKETS)
ITERATION_TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PARAMS_N = [1, 2, 5, 10, 20]
NUM_PREEMPTIONS = [1, 2, 3, 4, 5, 10, 20]
NIXL_XFER = list(NIXL_XFER_BUCKETS)
NIXL_POST = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]
NIXL_BYTES = [float(2 ** (10 + i)) for i in range(1, 25, 2)]
NIXL_DESCRIPTORS = [10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000]
HTTP_HIGHR = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1,
    1.5,
    2,
    2.5,
    3,
    3.5,
    4,
    4.5,
    5,
    7.5,
    10,
    30,
    60,
]
HTTP_FEW = [0.1, 0.5, 1]

_NIXL = "NIXL KV Cache transfers."
_MFU = "(for Model Flops Utilization calculations)."
_HTTP_TAIL = "Only value of header is respected. Otherwise ignored. No percentile calculated. "

# cache_config_info labels as vLLM 0.32 exposes them; the ones the simulator models are overridden.
_CACHE_CONFIG = {
    "_block_size_resolved": "True",
    "cache_dtype": "auto",
    "cache_hit_alignment_tokens": "None",
    "enable_mamba_shared_prefix_checkpoint": "False",
    "enable_prefix_caching": "True",
    "gpu_memory_utilization": "0.92",
    "hash_block_size": "None",
    "is_attention_free": "False",
    "kv_cache_dtype_skip_layers": "[]",
    "kv_cache_layout": "None",
    "kv_offloading_backend": "native",
    "kv_offloading_size": "None",
    "kv_sharing_fast_prefill": "False",
    "mamba_block_size": "None",
    "mamba_cache_dtype": "auto",
    "mamba_cache_mode": "none",
    "mamba_page_size_padded": "None",
    "mamba_ssm_cache_dtype": "float32",
    "num_cpu_blocks": "None",
    "num_gpu_blocks_override": "None",
    "prefix_cache_retention_interval": "0",
    "prefix_caching_hash_algo": "sha256",
    "prefix_match_unit": "None",
    "replayssm_buffer_len": "16",
    "skip_page_size_padded": "None",
    "sliding_window": "None",
    "swa_bounded_replay": "True",
    "use_kda_recoverssm": "False",
    "use_replayssm": "False",
    "user_specified_block_size": "False",
}


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """vLLM's request_tokens buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return out
            out.append(float(value))
        exponent += 1


_BASE = ("model_name", "engine")
_TOKENS: Final = "tokens"  # stands for the request-token buckets, which follow --max-model-len
_WAITING_BY_REASON = (
    "Number of waiting requests by reason. Reason labels: "
    "'capacity' = waiting for scheduling capacity; "
    "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). "
    "Sum of all reasons equals vllm:num_requests_waiting."
)
_KV_FETCH_BY_STAGE = (
    "Number of waiting requests by async KV load stage. Stage labels: 'waiting_to_start' = needs an "
    "async KV load that has not started; 'in_progress' = load started and not yet reported finished; "
    "'completed_waiting' = load finished, request not running yet."
)
_SLEEP_STATE = (
    "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
    "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2."
)
_CACHED_BY_SOURCE = (
    "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), "
    "host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
    "external_unspecified. Counted at admission; "
    "sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits."
)


@dataclass(frozen=True)
class _Fam:
    """One family on the page. ``attr`` is the attribute that feeds it ("": exported, never fed).
    Labels named ``model_name`` and ``engine`` take the instance's values; with ``children`` the last
    label's series are created up front and ``attr`` holds them by value; a family with other labels
    (or none) is kept whole and labelled as it is fed."""

    attr: str
    kind: Any  # Counter, Gauge, Histogram or Summary
    name: str
    help: str
    buckets: Sequence[float] | Literal["tokens"] | None = (
        None  # a histogram's; _TOKENS: the request-token ones
    )
    labels: Sequence[str] = _BASE
    children: Sequence[str] = ()


# vLLM's families (and NIXL's), in the order vLLM registers them.
_VLLM: tuple[_Fam, ...] = (
    _Fam(
        "nixl_xfer",
        Histogram,
        "vllm:nixl_xfer_time_seconds",
        f"Histogram of transfer duration for {_NIXL}",
        NIXL_XFER,
    ),
    _Fam(
        "nixl_post",
        Histogram,
        "vllm:nixl_post_time_seconds",
        f"Histogram of transfer post time for {_NIXL}",
        NIXL_POST,
    ),
    _Fam(
        "nixl_bytes",
        Histogram,
        "vllm:nixl_bytes_transferred",
        f"Histogram of bytes transferred per {_NIXL}",
        NIXL_BYTES,
    ),
    _Fam(
        "nixl_desc",
        Histogram,
        "vllm:nixl_num_descriptors",
        "Histogram of number of descriptors per NIXL  KV Cache transfers.",
        NIXL_DESCRIPTORS,
    ),
    _Fam(
        "nixl_failed",
        Counter,
        "vllm:nixl_num_failed_transfers",
        "Number of failed NIXL KV Cache transfers, including handshake and notification failures. "
        "NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.",
    ),
    _Fam(
        "nixl_failed_notifs",
        Counter,
        "vllm:nixl_num_failed_notifications",
        "Number of failed NIXL KV Cache notifications. Retained for compatibility; these failures are "
        "also included in vllm:nixl_num_failed_transfers.",
    ),
    _Fam(
        "nixl_expired",
        Counter,
        "vllm:nixl_num_kv_expired_reqs",
        "Number of requests that had their KV expire. NOTE: This metric is tracked on the P instance.",
    ),
    _Fam(
        "nixl_after_expiry",
        Counter,
        "vllm:nixl_num_notifications_after_expiry",
        "Number of completion notifications for requests that were no longer tracked, usually because "
        "their KV lease expired. The KV blocks may have been reused before the transfer finished. "
        "Counted per notification (one per remote rank), not per request.",
    ),
    _Fam(
        "",
        Counter,
        "vllm:estimated_flops_per_gpu",
        f"Estimated number of floating point operations per GPU {_MFU}",
    ),
    _Fam(
        "",
        Counter,
        "vllm:estimated_read_bytes_per_gpu",
        f"Estimated number of bytes read from memory per GPU {_MFU}",
    ),
    _Fam(
        "",
        Counter,
        "vllm:estimated_write_bytes_per_gpu",
        f"Estimated number of bytes written to memory per GPU {_MFU}",
    ),
    _Fam("running", Gauge, "vllm:num_requests_running", "Number of requests in model execution batches."),
    _Fam("waiting", Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    _Fam(
        "_waiting_by_reason",
        Gauge,
        "vllm:num_requests_waiting_by_reason",
        _WAITING_BY_REASON,
        labels=(*_BASE, "reason"),
        children=("capacity", "deferred"),
    ),
    _Fam(
        "stages",
        Gauge,
        "vllm:num_requests_kv_fetch_by_stage",
        _KV_FETCH_BY_STAGE,
        labels=(*_BASE, "stage"),
        children=STAGES,
    ),
    _Fam(
        "_sleep_state",
        Gauge,
        "vllm:engine_sleep_state",
        _SLEEP_STATE,
        labels=(*_BASE, "sleep_state"),
        children=("awake", "weights_offloaded", "discard_all"),
    ),
    _Fam("kv_cache_usage", Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    _Fam(
        "prefix_queries",
        Counter,
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    _Fam(
        "prefix_hits",
        Counter,
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
    ),
    _Fam(
        "ext_queries",
        Counter,
        "vllm:external_prefix_cache_queries",
        "External prefix cache queries from KV connector cross-instance cache sharing, "
        "in terms of number of queried tokens.",
    ),
    _Fam(
        "ext_hits",
        Counter,
        "vllm:external_prefix_cache_hits",
        "External prefix cache hits from KV connector cross-instance cache sharing, "
        "in terms of number of cached tokens.",
    ),
    _Fam(
        "",
        Counter,
        "vllm:mm_cache_queries",
        "Multi-modal cache queries, in terms of number of queried items.",
    ),
    _Fam("", Counter, "vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items."),
    _Fam("preemptions", Counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine."),
    _Fam("prompt_tokens", Counter, "vllm:prompt_tokens", "Number of prefill tokens processed."),
    _Fam(
        "_prompt_by_source",
        Counter,
        "vllm:prompt_tokens_by_source",
        "Number of prompt tokens by source.",
        labels=(*_BASE, "source"),
        children=("local_compute", "local_cache_hit", "external_kv_transfer"),
    ),
    _Fam(
        "cached", Counter, "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
    ),
    _Fam(
        "_cached_by_source",
        Counter,
        "vllm:prompt_tokens_cached_by_source",
        _CACHED_BY_SOURCE,
        labels=(*_BASE, "source"),
        children=("device", "host", "p2p", "disk", "external_unspecified"),
    ),
    _Fam("generation_tokens", Counter, "vllm:generation_tokens", "Number of generation tokens processed."),
    _Fam(
        "success",
        Counter,
        "vllm:request_success",
        "Count of successfully processed requests.",
        labels=(*_BASE, "finished_reason"),
        children=FINISH_REASONS,
    ),
    _Fam(
        "rejections",
        Counter,
        "vllm:admission_rejections",
        "Number of admission attempts rejected by a queue limit, by reason.",
        labels=("model_name", "reason"),
        children=("max_num_queued_reqs", "max_num_queued_tokens"),
    ),
    _Fam(
        "req_prompt", Histogram, "vllm:request_prompt_tokens", "Number of prefill tokens processed.", _TOKENS
    ),
    _Fam(
        "req_generation",
        Histogram,
        "vllm:request_generation_tokens",
        "Number of generation tokens processed.",
        _TOKENS,
    ),
    _Fam(
        "iteration",
        Histogram,
        "vllm:iteration_tokens_total",
        "Histogram of number of tokens per engine_step.",
        ITERATION_TOKENS,
    ),
    _Fam(
        "max_gen",
        Histogram,
        "vllm:request_max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.",
        _TOKENS,
    ),
    _Fam("params_n", Histogram, "vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N),
    _Fam(
        "params_max_tokens",
        Histogram,
        "vllm:request_params_max_tokens",
        "Histogram of the max_tokens request parameter.",
        _TOKENS,
    ),
    _Fam(
        "ttft",
        Histogram,
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        TTFT,
    ),
    _Fam(
        "itl",
        Histogram,
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        ITL,
    ),
    _Fam(
        "tpot",
        Histogram,
        "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        ITL,
    ),
    _Fam(
        "e2e",
        Histogram,
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        REQUEST_LATENCY,
    ),
    _Fam(
        "queue",
        Histogram,
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        REQUEST_LATENCY,
    ),
    _Fam(
        "inference",
        Histogram,
        "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        REQUEST_LATENCY,
    ),
    _Fam(
        "prefill",
        Histogram,
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        REQUEST_LATENCY,
    ),
    _Fam(
        "decode",
        Histogram,
        "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        REQUEST_LATENCY,
    ),
    _Fam(
        "req_preemptions",
        Histogram,
        "vllm:request_num_preemptions",
        "Histogram of the number of times a request was preempted.",
        NUM_PREEMPTIONS,
    ),
    _Fam(
        "kv_computed",
        Histogram,
        "vllm:request_prefill_kv_computed_tokens",
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
        _TOKENS,
    ),
)

# prometheus-fastapi-instrumentator's families, after vllm:cache_config_info.
_HTTP: tuple[_Fam, ...] = (
    _Fam(
        "_http_requests",
        Counter,
        "http_requests_total",
        "Total number of requests by method, status and handler.",
        labels=("method", "status", "handler"),
    ),
    _Fam(
        "_http_req_size",
        Summary,
        "http_request_size_bytes",
        f"Content length of incoming requests by handler. {_HTTP_TAIL}",
        labels=("handler",),
    ),
    _Fam(
        "_http_resp_size",
        Summary,
        "http_response_size_bytes",
        f"Content length of outgoing responses by handler. {_HTTP_TAIL}",
        labels=("handler",),
    ),
    _Fam(
        "_http_highr",
        Histogram,
        "http_request_duration_highr_seconds",
        "Latency with many buckets but no API specific labels. Made for more accurate percentile "
        "calculations. ",
        HTTP_HIGHR,
        labels=(),
    ),
    _Fam(
        "_http_duration",
        Histogram,
        "http_request_duration_seconds",
        "Latency with only few buckets by handler. Made to be only used if aggregation by handler is "
        "important. ",
        HTTP_FEW,
        labels=("method", "handler"),
    ),
)


def _family(fam: _Fam, registry: CollectorRegistry, known: dict[str, str], tokens: list[float]) -> Any:
    """Register one family; what its ``attr`` holds (see :class:`_Fam`)."""
    extra: dict[str, Any] = {}
    if fam.buckets is not None:
        extra["buckets"] = tokens if fam.buckets == _TOKENS else fam.buckets
    metric = fam.kind(fam.name, fam.help, fam.labels, registry=registry, **extra)
    values = [known[name] for name in fam.labels if name in known]
    if fam.children:
        return {child: metric.labels(*values, child) for child in fam.children}
    if fam.labels and len(values) == len(fam.labels):
        return metric.labels(*values)
    return metric


def _cache_config_info(
    registry: CollectorRegistry, cfg: SimulatorConfig, kv_bytes_per_token: int, engine: str
) -> None:
    """vllm:cache_config_info: vLLM 0.32's labels, the ones the simulator models overridden."""
    tokens_total = cfg.kv_capacity_blocks * cfg.block_size
    info = dict(_CACHE_CONFIG)
    info.update(
        block_size=str(cfg.block_size),
        cache_dtype=cfg.cache_dtype,
        effective_attention_block_size=str(cfg.block_size),
        enable_prefix_caching=str(cfg.prefix_caching),
        engine=engine,
        num_gpu_blocks=str(cfg.kv_capacity_blocks),
        kv_cache_size_tokens=str(tokens_total),
        kv_cache_memory_bytes=str(tokens_total * kv_bytes_per_token),
        kv_cache_max_concurrency=str(float(tokens_total) / cfg.max_model_len),
    )
    Gauge(
        "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", sorted(info), registry=registry
    ).labels(**info).set(1)


class _ProcessOf(Collector):
    """The process collector's families, with this instance's own start time: a simulated restart
    moves it, as a real vLLM's restart does."""

    def __init__(self, started: float) -> None:
        self.started = started

    def collect(self) -> Iterator[Metric]:
        for fam in PROCESS_COLLECTOR.collect():
            if fam.name == "process_start_time_seconds":
                fam = GaugeMetricFamily(fam.name, fam.documentation, value=self.started)
            yield fam


class VllmMetrics:
    """Prometheus families of one instance, and the engine observer that feeds them."""

    # set from the tables _VLLM and _HTTP by their ``attr``
    nixl_xfer: Histogram
    nixl_post: Histogram
    nixl_bytes: Histogram
    nixl_desc: Histogram
    nixl_failed: Counter
    nixl_failed_notifs: Counter
    nixl_expired: Counter
    nixl_after_expiry: Counter
    running: Gauge
    waiting: Gauge
    _waiting_by_reason: dict[str, Gauge]
    stages: dict[str, Gauge]
    _sleep_state: dict[str, Gauge]
    kv_cache_usage: Gauge
    prefix_queries: Counter
    prefix_hits: Counter
    ext_queries: Counter
    ext_hits: Counter
    preemptions: Counter
    prompt_tokens: Counter
    _prompt_by_source: dict[str, Counter]
    cached: Counter
    _cached_by_source: dict[str, Counter]
    generation_tokens: Counter
    success: dict[str, Counter]
    rejections: dict[str, Counter]
    req_prompt: Histogram
    req_generation: Histogram
    iteration: Histogram
    max_gen: Histogram
    params_n: Histogram
    params_max_tokens: Histogram
    ttft: Histogram
    itl: Histogram
    tpot: Histogram
    e2e: Histogram
    queue: Histogram
    inference: Histogram
    prefill: Histogram
    decode: Histogram
    req_preemptions: Histogram
    kv_computed: Histogram
    _http_requests: Counter
    _http_req_size: Summary
    _http_resp_size: Summary
    _http_highr: Histogram
    _http_duration: Histogram

    def __init__(
        self, model_name: str, cfg: SimulatorConfig, kv_bytes_per_token: int, engine: str = "0"
    ) -> None:
        self.registry = r = CollectorRegistry(auto_describe=False)
        for collector in (GC_COLLECTOR, PLATFORM_COLLECTOR, _ProcessOf(round(time.time(), 2))):
            r.register(collector)
        self._lv = (model_name, engine)
        known = {"model_name": model_name, "engine": engine}
        tokens = build_1_2_5_buckets(cfg.max_model_len)
        self._register(_VLLM, known, tokens)
        self._sleep_state["awake"].set(1)
        self.waiting_capacity = self._waiting_by_reason["capacity"]
        self.waiting_deferred = self._waiting_by_reason["deferred"]
        self.src_local = self._prompt_by_source["local_compute"]
        self.src_cache = self._prompt_by_source["local_cache_hit"]
        self.src_external = self._prompt_by_source["external_kv_transfer"]
        self.cached_p2p = self._cached_by_source["p2p"]
        self.cached_device = self._cached_by_source["device"]
        _cache_config_info(r, cfg, kv_bytes_per_token, engine)
        self._register(_HTTP, known, tokens)

    def _register(self, table: Sequence[_Fam], known: dict[str, str], tokens: list[float]) -> None:
        for fam in table:
            held = _family(fam, self.registry, known, tokens)
            if fam.attr:
                setattr(self, fam.attr, held)

    # -- HTTP (prometheus-fastapi-instrumentator's families) ---------------------------

    def http_request(
        self, handler: str, method: str, status: int, req_bytes: int, resp_bytes: int, seconds: float
    ) -> None:
        self._http_requests.labels(method, f"{status // 100}xx", handler).inc()
        self._http_req_size.labels(handler).observe(req_bytes)
        self._http_resp_size.labels(handler).observe(resp_bytes)
        self._http_highr.observe(seconds)
        self._http_duration.labels(method, handler).observe(seconds)

    # -- scrape --------------------------------------------------------------------

    def render(self, gauges: dict[str, float]) -> bytes:
        self.running.set(gauges["running"])
        self.waiting_capacity.set(gauges["waiting_capacity"])
        self.waiting_deferred.set(gauges["waiting_deferred"])
        self.waiting.set(gauges["waiting_capacity"] + gauges["waiting_deferred"])
        for stage in STAGES:
            self.stages[stage].set(gauges[stage])
        self.kv_cache_usage.set(gauges["kv_cache_usage"])
        return generate_latest(self.registry)

    # -- EngineObserver ------------------------------------------------------------

    def admitted(self, req: SimRequest) -> None:
        # vLLM's scheduler records both at admission, queried = the request's tokens, hits = the
        # tokens found locally / promised by the connector (on D: what it pulls from P)
        self.prefix_queries.inc(req.prompt_tokens)
        self.prefix_hits.inc(req.local_cached_tokens)
        self.ext_queries.inc(req.prompt_tokens)
        if req.remote is not None:
            self.ext_hits.inc(req.prompt_tokens - req.local_cached_tokens)

    def first_token(self, req: SimRequest, now: float) -> None:
        self.ttft.observe(now - req.arrival)
        self.prompt_tokens.inc(req.prompt_tokens)
        local, external = req.local_cached_tokens, req.external_tokens
        self.src_local.inc(req.prompt_tokens - local - external)
        if local:
            self.src_cache.inc(local)
            self.cached_device.inc(local)
        if external:
            self.src_external.inc(external)
            self.cached_p2p.inc(external)
        if local or external:
            self.cached.inc(local + external)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def step(self, num_tokens: int, generated: int) -> None:
        if num_tokens:
            self.iteration.observe(num_tokens)
        if generated:
            self.generation_tokens.inc(generated)

    def finished(self, req: SimRequest, now: float) -> None:
        self.success[req.finish_reason or "abort"].inc()
        if req.first_token_ts is None or req.scheduled_ts is None:
            self.e2e.observe(now - req.arrival)
            return
        last = req.last_token_ts or req.first_token_ts
        decode = last - req.first_token_ts
        self.e2e.observe(now - req.arrival)
        self.queue.observe(req.scheduled_ts - req.queued_ts)
        self.prefill.observe(req.first_token_ts - req.scheduled_ts)
        self.decode.observe(decode)
        self.inference.observe(last - req.scheduled_ts)
        self.tpot.observe(decode / (req.generated - 1) if req.generated > 1 else 0.0)
        self.req_prompt.observe(req.prompt_tokens)
        self.req_generation.observe(req.generated)
        self.max_gen.observe(req.max_tokens)
        self.params_n.observe(req.n)
        if req.params_max_tokens is not None:
            self.params_max_tokens.observe(req.params_max_tokens)
        self.req_preemptions.observe(req.num_preemptions)
        self.kv_computed.observe(req.prompt_tokens - req.cached_tokens)

    def preempted(self) -> None:
        self.preemptions.inc()

    def transfer_done(self, t: Transfer) -> None:
        self.nixl_xfer.observe(t.xfer_s)
        self.nixl_post.observe(t.post_s)
        self.nixl_bytes.observe(t.nbytes)
        self.nixl_desc.observe(t.descriptors)

    def transfer_failed(self) -> None:
        self.nixl_failed.inc()

    def kv_expired(self) -> None:
        self.nixl_expired.inc()

    def notification_after_expiry(self) -> None:
        self.nixl_after_expiry.inc()
