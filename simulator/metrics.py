"""An instance's ``/metrics``: the same families as real vLLM 0.32/0.33 with NIXL.

Names, types, HELP text, label names and bucket bounds are copied from vLLM (checked
against the real captures in tests/simulator/test_metrics_conformance.py); the text is
rendered by prometheus_client, as vLLM's is, so label order, float formatting and the
``_created`` samples match. Values follow the engine's events (``VllmMetrics`` is the
engine's ``EngineObserver``); gauges are read from the engine when scraped. One registry
per simulated instance; a restarted instance gets a fresh one, as a restarted vLLM does.
This module must not model anything: it only records what the engine reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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


class VllmMetrics:
    """Prometheus families of one instance, and the engine observer that feeds them."""

    def __init__(
        self, model_name: str, cfg: SimulatorConfig, kv_bytes_per_token: int, engine: str = "0"
    ) -> None:
        self.registry = r = CollectorRegistry(auto_describe=False)
        for collector in (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR):
            r.register(collector)
        base = ["model_name", "engine"]
        lv = (model_name, engine)
        self._lv = lv

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, base, buckets=buckets, registry=r).labels(*lv)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, base, registry=r).labels(*lv)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, base, registry=r).labels(*lv)

        self.nixl_xfer = hist(
            "vllm:nixl_xfer_time_seconds", f"Histogram of transfer duration for {_NIXL}", NIXL_XFER
        )
        self.nixl_post = hist(
            "vllm:nixl_post_time_seconds", f"Histogram of transfer post time for {_NIXL}", NIXL_POST
        )
        self.nixl_bytes = hist(
            "vllm:nixl_bytes_transferred", f"Histogram of bytes transferred per {_NIXL}", NIXL_BYTES
        )
        self.nixl_desc = hist(
            "vllm:nixl_num_descriptors",
            "Histogram of number of descriptors per NIXL  KV Cache transfers.",
            NIXL_DESCRIPTORS,
        )
        self.nixl_failed = counter(
            "vllm:nixl_num_failed_transfers",
            "Number of failed NIXL KV Cache transfers, including handshake and notification failures. "
            "NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.",
        )
        self.nixl_failed_notifs = counter(
            "vllm:nixl_num_failed_notifications",
            "Number of failed NIXL KV Cache notifications. Retained for compatibility; these failures are "
            "also included in vllm:nixl_num_failed_transfers.",
        )
        self.nixl_expired = counter(
            "vllm:nixl_num_kv_expired_reqs",
            "Number of requests that had their KV expire. NOTE: This metric is tracked on the P instance.",
        )
        self.nixl_after_expiry = counter(
            "vllm:nixl_num_notifications_after_expiry",
            "Number of completion notifications for requests that were no longer tracked, usually because "
            "their KV lease expired. The KV blocks may have been reused before the transfer finished. "
            "Counted per notification (one per remote rank), not per request.",
        )
        counter(
            "vllm:estimated_flops_per_gpu", f"Estimated number of floating point operations per GPU {_MFU}"
        )
        counter(
            "vllm:estimated_read_bytes_per_gpu", f"Estimated number of bytes read from memory per GPU {_MFU}"
        )
        counter(
            "vllm:estimated_write_bytes_per_gpu",
            f"Estimated number of bytes written to memory per GPU {_MFU}",
        )
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: "
            "'capacity' = waiting for scheduling capacity; "
            "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). "
            "Sum of all reasons equals vllm:num_requests_waiting.",
            [*base, "reason"],
            registry=r,
        )
        self.waiting_capacity = by_reason.labels(*lv, "capacity")
        self.waiting_deferred = by_reason.labels(*lv, "deferred")
        by_stage = Gauge(
            "vllm:num_requests_kv_fetch_by_stage",
            "Number of waiting requests by async KV load stage. Stage labels: 'waiting_to_start' = needs an "
            "async KV load that has not started; 'in_progress' = load started and not yet reported finished; "
            "'completed_waiting' = load finished, request not running yet.",
            [*base, "stage"],
            registry=r,
        )
        self.stages = {stage: by_stage.labels(*lv, stage) for stage in STAGES}
        sleep = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            [*base, "sleep_state"],
            registry=r,
        )
        sleep.labels(*lv, "awake").set(1)
        sleep.labels(*lv, "weights_offloaded")
        sleep.labels(*lv, "discard_all")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.ext_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
        )
        self.ext_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
        )
        counter("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items.")
        counter("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            [*base, "source"],
            registry=r,
        )
        self.src_local = by_source.labels(*lv, "local_compute")
        self.src_cache = by_source.labels(*lv, "local_cache_hit")
        self.src_external = by_source.labels(*lv, "external_kv_transfer")
        self.cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        cached_by = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), "
            "host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
            "external_unspecified. Counted at admission; "
            "sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
            [*base, "source"],
            registry=r,
        )
        cached_children = {
            s: cached_by.labels(*lv, s) for s in ("device", "host", "p2p", "disk", "external_unspecified")
        }
        self.cached_p2p = cached_children["p2p"]
        self.cached_device = cached_children["device"]
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*base, "finished_reason"],
            registry=r,
        )
        self.success = {reason: success.labels(*lv, reason) for reason in FINISH_REASONS}
        rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"],
            registry=r,
        )
        self.rejections = {
            reason: rejections.labels(model_name, reason)
            for reason in ("max_num_queued_reqs", "max_num_queued_tokens")
        }
        tokens = build_1_2_5_buckets(cfg.max_model_len)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.req_generation = hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.iteration = hist(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS
        )
        self.max_gen = hist(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tokens,
        )
        self.params_n = hist("vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N)
        self.params_max_tokens = hist(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens
        )
        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL
        )
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL,
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY,
        )
        self.queue = hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY,
        )
        self.inference = hist(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY,
        )
        self.prefill = hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY,
        )
        self.decode = hist(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY,
        )
        self.req_preemptions = hist(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            NUM_PREEMPTIONS,
        )
        self.kv_computed = hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tokens,
        )
        tokens_total = cfg.kv_capacity_blocks * cfg.block_size
        info = dict(_CACHE_CONFIG)
        info.update(
            block_size=str(cfg.block_size),
            effective_attention_block_size=str(cfg.block_size),
            enable_prefix_caching=str(cfg.prefix_caching),
            engine=engine,
            num_gpu_blocks=str(cfg.kv_capacity_blocks),
            kv_cache_size_tokens=str(tokens_total),
            kv_cache_memory_bytes=str(tokens_total * kv_bytes_per_token),
            kv_cache_max_concurrency=str(float(tokens_total) / cfg.max_model_len),
        )
        Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", sorted(info), registry=r
        ).labels(**info).set(1)
        self._http_requests = Counter(
            "http_requests_total",
            "Total number of requests by method, status and handler.",
            ["method", "status", "handler"],
            registry=r,
        )
        self._http_req_size = Summary(
            "http_request_size_bytes",
            f"Content length of incoming requests by handler. {_HTTP_TAIL}",
            ["handler"],
            registry=r,
        )
        self._http_resp_size = Summary(
            "http_response_size_bytes",
            f"Content length of outgoing responses by handler. {_HTTP_TAIL}",
            ["handler"],
            registry=r,
        )
        self._http_highr = Histogram(
            "http_request_duration_highr_seconds",
            "Latency with many buckets but no API specific labels. Made for more accurate percentile "
            "calculations. ",
            buckets=HTTP_HIGHR,
            registry=r,
        )
        self._http_duration = Histogram(
            "http_request_duration_seconds",
            "Latency with only few buckets by handler. Made to be only used if aggregation by handler is "
            "important. ",
            ["method", "handler"],
            buckets=HTTP_FEW,
            registry=r,
        )

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
