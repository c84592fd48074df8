"""What one run measured: the fleet's own counters over the measured phase, and the client's figures.

A :class:`Snapshot` of every P's ``vllm:prefix_cache_hits_total`` / ``queries_total`` and its
``vllm:request_queue_time_seconds`` histogram, and of the proxy's ``pdscope_proxy_routes_total``
by path, is taken at the start and at the end of the measured phase; the difference is the
phase's. The P hit rate is hits / queries summed over the P instances (tokens, as vLLM counts
them). With conditional disaggregation a request D serves alone never reaches a P, so the P hit
rate covers only the requests sent through P; the fleet's **reuse** covers them all: one minus the
prompt tokens computed anywhere (``vllm:prompt_tokens_by_source{source="local_compute"}`` on P and
D; vLLM counts them at a request's first token) over the prompt tokens of the requests whose first
token came in the phase. Queue waits over the TTFT budget are counted
from the histogram, whose bucket edges include the budget, so the count is exact; the largest
wait is known only to its bucket.
"""

from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pdscope.stats import percentile
from simulator.workload import RequestResult, summarize

QUEUE = "vllm:request_queue_time_seconds"
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
# the proxy's KV-aware counters kept per run: routes by reason, predictions checked against vLLM's report
PROXY_COUNTERS = (
    "pdscope_proxy_routes_total",
    "pdscope_proxy_kv_hit_checks_total",
    "pdscope_proxy_kv_checked_cached_tokens_total",
    "pdscope_proxy_retries_total",
    "pdscope_proxy_rejections_total",
    "pdscope_proxy_upstream_failures_total",
)


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def _sum(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(v for _, v in samples.get(name, []))


@dataclass
class PStats:
    hits: float = 0.0
    queries: float = 0.0
    queue_buckets: dict[float, float] = field(default_factory=dict)  # le -> cumulative count
    queue_count: float = 0.0
    computed: float = 0.0  # prompt tokens this instance computed itself (not cached, not pulled)


@dataclass
class Snapshot:
    p: dict[str, PStats] = field(default_factory=dict)
    computed: float = 0.0  # prompt tokens computed anywhere in the fleet (P and D)
    routes: dict[str, float] = field(default_factory=dict)  # path -> requests
    proxy: dict[str, float] = field(default_factory=dict)  # the KV-aware counters below, "name{labels}"
    errors: list[str] = field(default_factory=list)


def _computed(s: dict[str, list[tuple[dict[str, str], float]]]) -> float:
    return sum(v for lab, v in s.get(BY_SOURCE, []) if lab.get("source") == "local_compute")


def snapshot(
    prefill_urls: dict[str, str], proxy_url: str | None, decode_urls: dict[str, str] | None = None
) -> Snapshot:
    snap = Snapshot()
    for name, url in (decode_urls or {}).items():
        try:
            snap.computed += _computed(scrape(url))
        except OSError as exc:
            snap.errors.append(f"{name}: {exc}")
    for name, url in prefill_urls.items():
        try:
            s = scrape(url)
        except OSError as exc:
            snap.errors.append(f"{name}: {exc}")
            continue
        st = PStats(_sum(s, "vllm:prefix_cache_hits_total"), _sum(s, "vllm:prefix_cache_queries_total"))
        for labels, v in s.get(QUEUE + "_bucket", []):
            le = float(labels.get("le", "inf"))
            st.queue_buckets[le] = st.queue_buckets.get(le, 0.0) + v
        st.queue_count = _sum(s, QUEUE + "_count")
        st.computed = _computed(s)
        snap.computed += st.computed
        snap.p[name] = st
    if proxy_url is not None:
        try:
            s = scrape(proxy_url)
        except OSError as exc:
            snap.errors.append(f"proxy: {exc}")
        else:
            for labels, v in s.get("pdscope_proxy_routes_total", []):
                path = labels.get("path", "?")
                snap.routes[path] = snap.routes.get(path, 0.0) + v
            for name in PROXY_COUNTERS:
                for labels, v in s.get(name, []):
                    key = name + "{" + ",".join(f"{k}={x}" for k, x in sorted(labels.items())) + "}"
                    snap.proxy[key] = snap.proxy.get(key, 0.0) + v
    return snap


def phase(
    a: Snapshot, b: Snapshot, ttft_budget_s: float, prompt_tokens: float | None = None
) -> dict[str, Any]:
    """The measured phase's fleet figures, from snapshots at its start (``a``) and end (``b``);
    ``prompt_tokens``: of the phase's requests (the client's), for the fleet's reuse."""
    hits = queries = 0.0
    per_p: dict[str, Any] = {}
    for name, end in b.p.items():
        start = a.p.get(name, PStats())
        h, q = end.hits - start.hits, end.queries - start.queries
        hits, queries = hits + h, queries + q
        buckets = {le: c - start.queue_buckets.get(le, 0.0) for le, c in end.queue_buckets.items()}
        count = end.queue_count - start.queue_count
        within = max((c for le, c in buckets.items() if le <= ttft_budget_s), default=0.0)
        covering = [le for le, c in sorted(buckets.items()) if c >= count > 0]
        per_p[name] = {
            "hit_rate": h / q if q else None,
            "requests": count,
            "queue_over_budget": count - within,
            "queue_max_le_s": covering[0] if covering else None,
        }
    routes = {k: v - a.routes.get(k, 0.0) for k, v in b.routes.items()}
    total_routes = sum(routes.values())
    decode_only = sum(v for k, v in routes.items() if "decode" in k and "prefill" not in k)
    computed = b.computed - a.computed
    return {
        "p_hit_rate": hits / queries if queries else None,
        "reuse": max(0.0, 1.0 - computed / prompt_tokens) if prompt_tokens else None,
        "computed_tokens": computed,
        "p_hits_tokens": hits,
        "p_queries_tokens": queries,
        "per_p": per_p,
        "queue_over_budget": sum(x["queue_over_budget"] for x in per_p.values()),
        "queue_max_le_s": max((x["queue_max_le_s"] or 0.0 for x in per_p.values()), default=None),
        "routes": routes,
        "decode_only_share": decode_only / total_routes if total_routes else None,
        "kv_checks": {k: v - a.proxy.get(k, 0.0) for k, v in b.proxy.items() if v - a.proxy.get(k, 0.0)},
        "scrape_errors": a.errors + b.errors,
    }


def figures(
    results: list[RequestResult], warm_s: float, measured_s: float, slo_ttft_s: float, slo_tpot_s: float
) -> dict[str, Any]:
    measured = [r for r in results if r.scheduled_s >= warm_s]
    s = summarize(measured, measured_s, slo_ttft_s, slo_tpot_s)
    ttfts = [r.ttft_s for r in measured if r.ok and r.ttft_s is not None]
    return {
        "requests": s["requests"],
        "completed": s["completed"],
        "offered_rps": s["requests"] / measured_s if measured_s else None,
        "goodput_rps": s["goodput_rps"],
        "slo_attainment": s["slo_attainment"],
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "tpot_p50_s": s["tpot_s"]["p50"],
        "errors": s["errors"],
    }


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b
