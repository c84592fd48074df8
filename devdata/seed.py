"""A realistic P/D fleet history written into a store, for tests, screenshots and the
dashboard benchmark. Never imported by the services (the dashboard only reads).

One decode instance's NIXL link degrades part-way through: its KV pulls slow down,
handoff and TTFT grow, some leases expire on P, the controller steps its weight down
and alerts fire. Everything else is steady Poisson-ish traffic. Requests share 16 system
prompts (Zipf-weighted, each with a home prefill instance the KV-aware router prefers); prompts
whose uncached part is short on a D holding their prefix go to D alone (``decode_only``); and
prefill-1's cache is cleared for two minutes late in the window, so vLLM reports far fewer cached
tokens than the router predicted there. Numbers are
self-consistent: snapshot counters and histograms are accumulated from the same
generated requests, so the pages' totals agree with each other.

Usage: ``seed_store(url, SeedSpec(end=time.time()))`` (the schema is migrated first).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import Engine, insert

from pdscope.vllmapi import ITL_BUCKETS, NIXL_XFER_BUCKETS, TTFT_BUCKETS
from store.db import make_engine
from store.migrate import upgrade
from store.models import Alert, AuditEvent, Decision, InstanceRow, RequestRecord, Snapshot, WeightOverride

# The request records' time and duration columns, seeded alike by the insert path and the bulk load.
_FLOAT_COLUMNS = (
    "proxy_in",
    "p_sent",
    "p_done",
    "d_sent",
    "first_token",
    "done",
    "p_queue_s",
    "p_prefill_s",
    "d_queue_s",
    "d_prefill_s",
    "e2e_s",
)

# vLLM's bounds, the seeded history's up to 40 s (TTFT) and 5 s (ITL)
TTFT_LE = tuple(b for b in TTFT_BUCKETS if b <= 40.0)
ITL_LE = tuple(b for b in ITL_BUCKETS if b <= 5.0)
XFER_LE = NIXL_XFER_BUCKETS
POST_LE = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
BYTES_LE = tuple(float(2 ** (10 + i)) for i in range(1, 24, 2))
DESC_LE = (
    10.0,
    20.0,
    30.0,
    50.0,
    75.0,
    100.0,
    200.0,
    400.0,
    1000.0,
    2000.0,
    4000.0,
    10000.0,
    20000.0,
    50000.0,
)


@dataclass(frozen=True)
class SeedSpec:
    """What history to write. ``requests`` overrides ``rate_per_s`` when set."""

    end: float
    duration_s: float = 1800.0
    rate_per_s: float = 3.0
    requests: int | None = None
    scrape_interval_s: float = 5.0
    prefill: tuple[str, ...] = ("prefill-0", "prefill-1")
    decode: tuple[str, ...] = ("decode-0", "decode-1", "decode-2")
    prefill_pool: str = "prefill"
    decode_pool: str = "decode"
    degraded: str | None = "decode-2"
    degrade_at: float = 0.55
    kv_bytes_per_token: int = 327680
    ttft_target_s: float = 2.0
    tpot_target_s: float = 0.1
    seed: int = 7
    chunk: int = 20_000
    shared_prefixes: int = 16
    keyed_share: float = 0.65  # requests whose prompt starts with one of the shared prefixes
    cache_clear: str | None = "prefill-1"  # its cache is emptied at cache_clear_at for cache_clear_s
    cache_clear_at: float = 0.75
    cache_clear_s: float = 120.0
    # the controller's history (decisions, overrides, audit events, alerts) written by hand; False: none,
    # for a real controller to be run over the seeded window (tests/controller/test_replay_seed.py)
    controller_history: bool = True


@dataclass(frozen=True)
class SeedSummary:
    requests: int
    snapshots: int
    decisions: int
    start: float
    end: float
    degraded: str | None
    slow_request_id: str | None
    lease_expiry_request_id: str | None
    counts: dict[str, int] = field(default_factory=dict)


def seed_store(url: str, spec: SeedSpec, *, migrate: bool = True) -> SeedSummary:
    """Migrate the store at ``url`` and write the history described by ``spec``."""
    if migrate:
        upgrade(url)
    engine = make_engine(url)
    try:
        return _seed(engine, spec)
    finally:
        engine.dispose()


def fleet_config_yaml(
    spec: SeedSpec,
    store_url: str,
    controller_port: int = 8300,
    model: str = "sim-llama-70b",
    mode: str = "enforce",
) -> str:
    """A pdscope.yaml naming the same instances, for pointing a dashboard at the seeded store."""

    def block(names: Sequence[str], base_port: int) -> str:
        return "\n".join(
            f'      - {{name: {n}, url: "http://127.0.0.1:{base_port + i}"}}' for i, n in enumerate(names)
        )

    return (
        f"model: {{name: {model}, kv_bytes_per_token: {spec.kv_bytes_per_token}}}\n"
        f"pools:\n  {spec.prefill_pool}:\n    role: prefill\n    instances:\n{block(spec.prefill, 18100)}\n"
        f"  {spec.decode_pool}:\n    role: decode\n    instances:\n{block(spec.decode, 18200)}\n"
        f"slo:\n  ttft: {{target_ms: {spec.ttft_target_s * 1000:g}}}\n"
        f"  tpot: {{target_ms: {spec.tpot_target_s * 1000:g}}}\n"
        f'store: {{url: "{store_url}"}}\n'
        f"controller: {{host: 127.0.0.1, port: {controller_port}, mode: {mode}}}\n"
    )


# -- requests ----------------------------------------------------------------------------


def request_id(index: int, seed: int) -> str:
    """The id of the ``index``-th seeded request (stable for a given seed)."""
    return f"cmpl-{index:07d}-{(index * 2654435761 + seed) & 0xFFFFFF:06x}"


@dataclass
class _Requests:
    cols: dict[str, np.ndarray]
    n: int


BLOCK = 16  # tokens per KV block


def prefix_key(k: int, seed: int) -> str:
    """The chain key (16 hex digits) of the ``k``-th shared prefix's deepest block."""
    return f"{(k * 0x9E3779B97F4A7C15 + seed * 0xBF58476D1CE4E5B9 + 1) % 2**64:016x}"


def _kv_routing(
    spec: SeedSpec, prompt: np.ndarray, p_idx: np.ndarray, proxy_in: np.ndarray, degraded_now: np.ndarray
) -> dict[str, np.ndarray]:
    """What KV-aware routing predicted and vLLM reported, per request (-1: none). Its own generator,
    so the rest of the history is the one it was before these columns existed."""
    rng = np.random.default_rng(spec.seed + 101)
    n, n_p, k_max = len(prompt), max(len(spec.prefill), 1), max(spec.shared_prefixes, 1)
    lengths = BLOCK * rng.integers(16, 97, k_max)  # 256 .. 1536 tokens
    zipf = 1.0 / np.arange(1, k_max + 1) ** 1.1
    k = rng.choice(k_max, n, p=zipf / zipf.sum())
    # most keyed requests are on the prefix's home P (k % n_p); the rest spilled to another P
    home = rng.random(n) < 0.85
    k_home = (k // n_p) * n_p + p_idx
    k_home = np.where(k_home >= k_max, k_home - n_p, k_home)
    k = np.where(home & (k_home >= 0), k_home, k)
    tokens = np.minimum(lengths[k], BLOCK * np.floor(0.85 * prompt / BLOCK).astype(np.int64))
    keyed = (rng.random(n) < spec.keyed_share) & (tokens >= BLOCK)
    tokens = np.where(keyed, tokens, -1)
    on_home = keyed & ((k % n_p) == p_idx)
    hot = keyed & (k < n_p)  # the hottest prefixes are held by every P (a second P took them)
    p_pred = np.where(on_home | hot, tokens, np.where(keyed, 0, 0))
    # vLLM's report: mostly what was predicted; some evicted since the router saw them; a few more
    r = rng.random(n)
    evicted = BLOCK * np.floor(rng.random(n) * np.maximum(p_pred, 0) / BLOCK).astype(np.int64)
    p_cached = np.where(r < 0.06, evicted, np.where((r > 0.97) & keyed, p_pred + BLOCK, p_pred))
    if spec.cache_clear in spec.prefill:
        at = spec.end - spec.duration_s + spec.cache_clear_at * spec.duration_s
        cleared = (p_idx == spec.prefill.index(spec.cache_clear)) & (proxy_in >= at)
        p_cached = np.where(cleared & (proxy_in < at + spec.cache_clear_s), 0, p_cached)
    d_holds = keyed & (rng.random(n) < 0.3)
    d_pred = np.where(d_holds, tokens, 0)
    # conditional disaggregation: D holds the prefix and the rest of the prompt is short
    decode_only = keyed & (prompt - tokens <= 96) & ~degraded_now & (rng.random(n) < 0.6)
    d_pred = np.where(decode_only, tokens, d_pred)
    d_local = np.where(decode_only & (rng.random(n) < 0.05), np.maximum(tokens - BLOCK, 0), d_pred)
    pulled = np.maximum(BLOCK * ((prompt - 1) // BLOCK) - d_local, 0)  # on the P/D path D pulls the rest
    return {
        "decode_only": decode_only,
        "prefix_k": np.where(keyed, k, -1),
        "prefix_tokens": tokens,
        "p_pred": np.where(decode_only, -1, p_pred),
        "p_cached": np.where(decode_only, -1, np.minimum(p_cached, BLOCK * (prompt // BLOCK))),
        "d_pred": d_pred,
        "d_local": d_local,
        "d_pulled": np.where(decode_only, 0, pulled),
        # D's usage.prompt_tokens_details.cached_tokens: its local hits plus what it pulled
        "d_cached": np.where(decode_only, d_local, d_local + pulled),
    }


def _gen_requests(spec: SeedSpec, rng: np.random.Generator) -> _Requests:
    start = spec.end - spec.duration_s
    n = spec.requests if spec.requests is not None else int(rng.poisson(spec.rate_per_s * spec.duration_s))
    # A burst in the middle third makes the arrival-rate plot and queues worth looking at.
    u = rng.random(n)
    burst = rng.random(n) < 0.15
    u[burst] = 0.30 + 0.08 * rng.random(int(burst.sum()))
    proxy_in = np.sort(start + u * spec.duration_s)
    degrade_ts = start + spec.degrade_at * spec.duration_s

    prompt = np.clip(rng.lognormal(math.log(900), 0.7, n), 16, 16000).astype(np.int64)
    output = np.clip(rng.lognormal(math.log(160), 0.8, n), 1, 4000).astype(np.int64)
    p_idx = rng.integers(0, len(spec.prefill), n)
    deg = spec.decode.index(spec.degraded) if spec.degraded in spec.decode else -1
    d_idx = _decode_choice(spec, rng, proxy_in, deg, degrade_ts + 60.0)
    degraded_now = (d_idx == deg) & (proxy_in >= degrade_ts)
    kv = _kv_routing(spec, prompt, p_idx, proxy_in, degraded_now)
    via_p = ~kv["decode_only"]
    t = _timings(spec, rng, _Load(start, proxy_in, prompt, output, degraded_now, kv))
    status, http, lease = _outcomes(rng, degraded_now, t["pull"])
    return _Requests(
        n=n,
        cols={
            **_timing_columns(proxy_in, t, status, via_p),
            "pull": t["pull"],
            "prompt": prompt,
            "completion": np.where(status == "ok", output, 0),
            "p_idx": p_idx,
            "d_idx": d_idx,
            "status": status,
            "http": http,
            "lease": lease,
            "kv_bytes": t["kv_bytes"],
            "rejected": status == "rejected",
            "via_p": via_p,
            **_routing_columns(kv, status == "rejected", np.isin(status, ("error", "timeout"))),
        },
    )


def _decode_choice(
    spec: SeedSpec, rng: np.random.Generator, proxy_in: np.ndarray, deg: int, react_ts: float
) -> np.ndarray:
    """Each request's D (an index into ``spec.decode``): after the controller reacts (``react_ts``),
    the degraded D (``deg``, -1: none) gets a quarter of its share."""
    n = len(proxy_in)
    d_weights = np.ones(len(spec.decode))
    d_idx = rng.choice(len(spec.decode), n, p=d_weights / d_weights.sum())
    if deg >= 0:
        moved = (proxy_in >= react_ts) & (d_idx == deg) & (rng.random(n) < 0.75)
        others = [i for i in range(len(spec.decode)) if i != deg]
        if others:
            d_idx[moved] = rng.choice(others, int(moved.sum()))
    return d_idx


@dataclass(frozen=True)
class _Load:
    """The drawn requests the timings are drawn for."""

    start: float
    proxy_in: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    degraded_now: np.ndarray  # sent to the degraded D after it degraded
    kv: dict[str, np.ndarray]  # :func:`_kv_routing`'s columns


def _timings(spec: SeedSpec, rng: np.random.Generator, ld: _Load) -> dict[str, np.ndarray]:
    """Each request's timestamps and durations, as if every request were served."""
    n, start, proxy_in, prompt = len(ld.proxy_in), ld.start, ld.proxy_in, ld.prompt
    via_p = ~ld.kv["decode_only"]
    in_burst = (proxy_in >= start + 0.30 * spec.duration_s) & (proxy_in < start + 0.38 * spec.duration_s)
    p_sent = proxy_in + rng.uniform(0.0008, 0.003, n)
    p_queue = rng.exponential(0.02, n) + np.where(in_burst, rng.exponential(0.25, n), 0.0)
    p_prefill = prompt * 0.00011 + rng.uniform(0.005, 0.02, n)
    p_done = p_sent + p_queue + p_prefill
    d_sent = p_done + rng.uniform(0.0005, 0.002, n)
    kv_bytes = prompt * spec.kv_bytes_per_token
    bandwidth = np.where(ld.degraded_now, rng.uniform(0.12e9, 0.3e9, n), rng.uniform(15e9, 25e9, n))
    pull = kv_bytes / bandwidth + rng.uniform(0.001, 0.004, n)
    d_queue = rng.exponential(0.01, n)
    first_step = rng.uniform(0.015, 0.035, n)
    # decode only: sent to D when it would have gone to P; no pull, D prefills the uncached part
    d_sent = np.where(via_p, d_sent, p_sent)
    pull = np.where(via_p, pull, 0.0)
    first_step = np.where(via_p, first_step, first_step + (prompt - ld.kv["d_local"]) * 0.00011)
    first_token = d_sent + d_queue + pull + first_step
    tpot = rng.normal(0.032, 0.006, n).clip(0.012) + np.where(ld.degraded_now, 0.015, 0.0)
    tpot = np.where(rng.random(n) < 0.01, tpot * 4, tpot)
    done = first_token + tpot * np.maximum(ld.output - 1, 0)
    return {
        "p_sent": p_sent,
        "p_queue": p_queue,
        "p_prefill": p_prefill,
        "p_done": p_done,
        "d_sent": d_sent,
        "kv_bytes": kv_bytes,
        "pull": pull,
        "d_queue": d_queue,
        "first_step": first_step,
        "first_token": first_token,
        "tpot": tpot,
        "done": done,
    }


def _outcomes(
    rng: np.random.Generator, degraded_now: np.ndarray, pull: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each request's status and HTTP status, and whether its lease expired on P (a timeout)."""
    n = len(pull)
    status = np.full(n, "ok", dtype=object)
    r = rng.random(n)
    status[r < 0.006] = "rejected"
    status[(r >= 0.006) & (r < 0.012)] = "error"
    status[(r >= 0.012) & (r < 0.016)] = "client_disconnect"
    lease = degraded_now & (pull > 3.0) & (rng.random(n) < 0.5)
    status[lease] = "timeout"
    http = np.where(
        status == "ok", 200, np.where(status == "rejected", 429, np.where(status == "timeout", 504, 502))
    )
    return status, http, lease


def _timing_columns(
    proxy_in: np.ndarray, t: dict[str, np.ndarray], status: np.ndarray, via_p: np.ndarray
) -> dict[str, np.ndarray]:
    """The request records' time and duration columns (NaN: null) once the outcomes are known: none
    on P for a request P did not see, no first token for one that failed."""
    rejected = status == "rejected"
    failed = np.isin(status, ("error", "timeout"))
    nan = np.full(len(proxy_in), np.nan)
    d_sent = np.where(rejected, nan, t["d_sent"])
    first_token = np.where(rejected | failed, nan, t["first_token"])
    done = np.where(rejected, proxy_in + 0.001, np.where(failed, d_sent + t["pull"], t["done"]))
    return {
        "proxy_in": proxy_in,
        "p_sent": np.where(rejected | ~via_p, nan, t["p_sent"]),
        "p_done": np.where(rejected | ~via_p, nan, t["p_done"]),
        "d_sent": d_sent,
        "first_token": first_token,
        "done": done,
        "p_queue_s": np.where(rejected | ~via_p, nan, t["p_queue"]),
        "p_prefill_s": np.where(rejected | ~via_p, nan, t["p_prefill"]),
        "d_queue_s": np.where(rejected, nan, t["d_queue"]),
        "d_prefill_s": np.where(rejected, nan, t["pull"] + t["first_step"]),
        "d_decode_s": done - first_token,
        "ttft_s": first_token - proxy_in,
        "tpot_s": np.where(status == "ok", t["tpot"], nan),
        "e2e_s": done - proxy_in,
    }


def _routing_columns(
    kv: dict[str, np.ndarray], rejected: np.ndarray, failed: np.ndarray
) -> dict[str, np.ndarray]:
    """The request records' routing columns as int arrays (-1: null): none for a rejected request
    (never routed), no D report for one D did not answer."""

    def unless(a: np.ndarray, gone: np.ndarray) -> np.ndarray:
        return np.where(gone, -1, a).astype(np.int64)

    return {
        "decode_only": kv["decode_only"] & ~rejected,
        "prefix_k": unless(kv["prefix_k"], rejected),
        "prefix_tokens_col": unless(kv["prefix_tokens"], rejected),
        "p_pred": unless(kv["p_pred"], rejected),
        "p_cached": unless(kv["p_cached"], rejected),
        "d_pred": unless(kv["d_pred"], rejected),
        "d_cached": unless(kv["d_cached"], rejected | failed),
        "d_local": kv["d_local"],
        "d_pulled": kv["d_pulled"],
    }


ROUTING_INT_COLUMNS = {
    "p_predicted_cached_tokens": "p_pred",
    "d_predicted_cached_tokens": "d_pred",
    "p_cached_tokens": "p_cached",
    "d_cached_tokens": "d_cached",
    "prefix_tokens": "prefix_tokens_col",
}


def _ints(a: np.ndarray) -> list[int | None]:
    """An int column as Python values, -1 as None."""
    return [None if v < 0 else v for v in a.tolist()]


def _route_paths(c: dict[str, np.ndarray], sl: slice) -> np.ndarray:
    paths = np.where(c["decode_only"][sl], "decode_only", "pd").astype(object)
    paths[c["rejected"][sl]] = None
    return paths


def _prefix_keys(c: dict[str, np.ndarray], sl: slice, seed: int) -> list[str | None]:
    return [None if k < 0 else prefix_key(k, seed) for k in c["prefix_k"][sl].tolist()]


def _floats(a: np.ndarray) -> list[float | None]:
    """A float column as Python values, NaN as None."""
    return [None if v != v else v for v in a.astype(float).tolist()]


def _request_rows(spec: SeedSpec, req: _Requests, rng: np.random.Generator) -> Iterator[list[dict[str, Any]]]:
    """Request-record rows in chunks, built column-wise (a million rows in seconds, not minutes)."""
    for lo in range(0, req.n, spec.chunk):
        hi = min(lo + spec.chunk, req.n)
        cols = _request_columns(spec, req.cols, lo, hi)
        keys = list(cols)
        rows = [dict(zip(keys, values, strict=True)) for values in zip(*cols.values(), strict=True)]
        for row in rows:
            row["attributes"] = {}
        yield rows


def _slo_flags(spec: SeedSpec, c: dict[str, np.ndarray], sl: slice) -> dict[str, list[bool | None]]:
    """The SLO columns as Python values: None where the figure is NaN (or, for both, the request failed)."""
    ttft, tpot, ok = c["ttft_s"][sl], c["tpot_s"][sl], c["status"][sl] == "ok"
    ttft_ok = (ttft <= spec.ttft_target_s).tolist()
    tpot_ok = (tpot <= spec.tpot_target_s).tolist()
    all_ok = ((ttft <= spec.ttft_target_s) & ~(tpot > spec.tpot_target_s)).tolist()
    return {
        "slo_ttft_met": [None if nan else v for nan, v in zip(np.isnan(ttft).tolist(), ttft_ok, strict=True)],
        "slo_tpot_met": [None if nan else v for nan, v in zip(np.isnan(tpot).tolist(), tpot_ok, strict=True)],
        "slo_met": [v if good else None for good, v in zip(ok.tolist(), all_ok, strict=True)],
    }


def _id_columns(spec: SeedSpec, lo: int, hi: int) -> dict[str, list[Any]]:
    """Requests ``lo``..``hi``: ids, endpoint and stream flag (for the insert path and the bulk load)."""
    idx = range(lo, hi)
    return {
        "request_id": [request_id(i, spec.seed) for i in idx],
        "trace_id": [f"{(i * 0x9E3779B97F4A7C15 + spec.seed) % 2**128:032x}" for i in idx],
        "endpoint": ["/v1/chat/completions" if i % 3 else "/v1/completions" for i in idx],
        "stream": [bool(i % 4) for i in idx],
    }


def _request_columns(spec: SeedSpec, c: dict[str, np.ndarray], lo: int, hi: int) -> dict[str, list[Any]]:
    """Request records ``lo``..``hi`` as Python values, column by column (the rows' key order)."""
    sl = slice(lo, hi)
    status = c["status"][sl]
    prompt = c["prompt"][sl]
    http = c["http"][sl]
    served = ~c["rejected"][sl]
    via_p = served & c["via_p"][sl]
    cols: dict[str, list[Any]] = {
        **_id_columns(spec, lo, hi),
        "p_instance": [
            spec.prefill[k] if s else None for k, s in zip(c["p_idx"][sl].tolist(), via_p, strict=True)
        ],
        "d_instance": [
            spec.decode[k] if s else None for k, s in zip(c["d_idx"][sl].tolist(), served, strict=True)
        ],
        "p_pool": [spec.prefill_pool if s else None for s in via_p],
        "d_pool": [spec.decode_pool if s else None for s in served],
        "status": status.tolist(),
        "http_status": http.tolist(),
        "error": [
            None if st in ("ok", "client_disconnect") else f"http {h}"
            for st, h in zip(status.tolist(), http.tolist(), strict=True)
        ],
        "retries": [0] * (hi - lo),
        "prompt_tokens": prompt.tolist(),
        "completion_tokens": c["completion"][sl].tolist(),
        "kv_blocks": [(p + 15) // 16 if s else None for p, s in zip(prompt.tolist(), via_p, strict=True)],
        "kv_bytes": [b if s else None for b, s in zip(c["kv_bytes"][sl].tolist(), via_p, strict=True)],
        "route_path": _route_paths(c, sl).tolist(),
        "prefix_key": _prefix_keys(c, sl, spec.seed),
        **{col: _ints(c[key][sl]) for col, key in ROUTING_INT_COLUMNS.items()},
        "d_decode_s": _floats(np.where(status == "ok", c["d_decode_s"][sl], np.nan)),
        "ttft_s": _floats(c["ttft_s"][sl]),
        "tpot_s": _floats(c["tpot_s"][sl]),
        **_slo_flags(spec, c, sl),
        "lease_expiry_suspect": c["lease"][sl].tolist(),
    }
    for name in _FLOAT_COLUMNS:
        cols[name] = _floats(c[name][sl])
    return cols


# -- snapshots -----------------------------------------------------------------------------


def _cum(times: np.ndarray, ticks: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Cumulative count (or weighted sum) of events with time ≤ each tick."""
    order = np.argsort(times, kind="stable")
    t = times[order]
    if weights is None:
        return np.searchsorted(t, ticks, side="right").astype(float)
    cs = np.concatenate([[0.0], np.cumsum(weights[order].astype(float))])
    return cs[np.searchsorted(t, ticks, side="right")]


def _hist_series(
    times: np.ndarray, values: np.ndarray, ticks: np.ndarray, le: tuple[float, ...]
) -> list[dict[str, Any]]:
    """One cumulative histogram per tick, from (observation time, value) pairs."""
    buckets = [_cum(times[values <= b], ticks) for b in le]
    buckets.append(_cum(times, ticks))
    sums = _cum(times, ticks, values)
    return [
        {
            "le": list(le),
            "counts": [float(b[k]) for b in buckets],
            "sum": round(float(sums[k]), 6),
            "count": float(buckets[-1][k]),
        }
        for k in range(len(ticks))
    ]


def _inflight(starts: np.ndarray, ends: np.ndarray, ticks: np.ndarray) -> np.ndarray:
    out: np.ndarray = _cum(starts, ticks) - _cum(ends, ticks)
    return out


def _snapshot_rows(
    spec: SeedSpec, req: _Requests, rng: np.random.Generator
) -> Iterator[list[dict[str, Any]]]:
    c = req.cols
    start = spec.end - spec.duration_s
    ticks = np.arange(start + spec.scrape_interval_s, spec.end + 1e-9, spec.scrape_interval_s)
    served = ~c["rejected"]
    ok = c["status"] == "ok"
    for role, names in (("prefill", spec.prefill), ("decode", spec.decode)):
        for idx, name in enumerate(names):
            mine = served & ((c["p_idx"] if role == "prefill" else c["d_idx"]) == idx)
            if role == "prefill":
                series = _prefill_series(c, mine & c["via_p"], ticks)
            else:
                series = _decode_series(c, mine, mine & ok, ticks, rng)
            pool = spec.prefill_pool if role == "prefill" else spec.decode_pool
            yield from _instance_snapshots(spec, (name, pool, role), start, ticks, series)


@dataclass(frozen=True)
class _Series:
    """One instance's figures at every tick, as its snapshots carry them."""

    running: np.ndarray
    waiting: np.ndarray
    kv: np.ndarray  # KV cache usage
    hist: dict[str, list[dict[str, Any]]]  # family -> one cumulative histogram per tick
    counters: dict[str, np.ndarray]  # column -> value per tick
    ttft_src: tuple[np.ndarray, np.ndarray]  # (time, value) of the TTFT observations
    pull_live: np.ndarray | None = None  # KV pulls in progress (D only)


def _prefill_series(c: dict[str, np.ndarray], mine: np.ndarray, ticks: np.ndarray) -> _Series:
    """A P's figures: ``mine``, the requests it prefilled."""
    t_end = c["p_done"][mine]
    running = _inflight(c["p_sent"][mine] + c["p_queue_s"][mine], t_end, ticks)
    hist = {
        "vllm:time_to_first_token_seconds": _hist_series(t_end, (t_end - c["p_sent"][mine]), ticks, TTFT_LE),
        "vllm:request_queue_time_seconds": _hist_series(t_end, c["p_queue_s"][mine], ticks, TTFT_LE),
    }
    expired_t = c["p_done"][c["lease"] & mine] + 30.0
    counters = {
        "prompt_tokens": _cum(t_end, ticks, c["prompt"][mine]),
        "prefix_cache_queries": _cum(t_end, ticks, c["prompt"][mine]),
        "prefix_cache_hits": _cum(t_end, ticks, np.maximum(c["p_cached"][mine], 0)),
        "generation_tokens": _cum(t_end, ticks),
        "requests_length": _cum(t_end, ticks),
        "nixl_kv_expired_reqs": _cum(expired_t, ticks),
        "nixl_xfer_time_sum": np.zeros(len(ticks)),
        "nixl_xfer_time_count": np.zeros(len(ticks)),
        "nixl_failed_transfers": np.zeros(len(ticks)),
    }
    return _Series(
        running=running,
        waiting=_inflight(c["p_sent"][mine], c["p_sent"][mine] + c["p_queue_s"][mine], ticks),
        kv=np.clip(running * 900 / 60000.0, 0, 1),
        hist=hist,
        counters=counters,
        ttft_src=(t_end, t_end - c["p_sent"][mine]),
    )


def _decode_series(
    c: dict[str, np.ndarray],
    mine_all: np.ndarray,
    mine_ok: np.ndarray,
    ticks: np.ndarray,
    rng: np.random.Generator,
) -> _Series:
    """A D's figures: ``mine_all``, the requests it served, ``mine_ok`` those that succeeded."""
    # decode-only requests pulled nothing: NIXL's figures count the P/D path only
    mine = mine_all & c["via_p"]
    xfer_t = c["d_sent"][mine] + c["d_queue_s"][mine] + c["pull"][mine]
    t_first = c["first_token"][mine_ok]
    running = _inflight(c["d_sent"][mine_all], c["done"][mine_all], ticks)
    post = rng.uniform(0.0006, 0.004, int(mine.sum()))
    nbytes = c["kv_bytes"][mine].astype(float)
    descs = np.ceil(c["prompt"][mine] / 16) * 4
    ttft_d = t_first - c["d_sent"][mine_ok]
    hist = {
        "vllm:time_to_first_token_seconds": _hist_series(t_first, ttft_d, ticks, TTFT_LE),
        "vllm:inter_token_latency_seconds": _hist_series(
            c["done"][mine_ok], c["tpot_s"][mine_ok], ticks, ITL_LE
        ),
        "vllm:nixl_xfer_time_seconds": _hist_series(xfer_t, c["pull"][mine], ticks, XFER_LE),
        "vllm:nixl_post_time_seconds": _hist_series(xfer_t, post, ticks, POST_LE),
        "vllm:nixl_bytes_transferred": _hist_series(xfer_t, nbytes, ticks, BYTES_LE),
        "vllm:nixl_num_descriptors": _hist_series(xfer_t, descs, ticks, DESC_LE),
    }
    return _Series(
        running=running,
        waiting=_inflight(c["d_sent"][mine_all], c["d_sent"][mine_all] + c["d_queue_s"][mine_all], ticks),
        kv=np.clip(running * 1100 / 120000.0, 0, 0.98),
        hist=hist,
        counters=_decode_counters(c, mine_all, mine_ok, ticks, post, nbytes, descs),
        ttft_src=(t_first, ttft_d),
        pull_live=_inflight(c["d_sent"][mine], c["d_sent"][mine] + c["pull"][mine], ticks),
    )


def _decode_counters(
    c: dict[str, np.ndarray],
    mine_all: np.ndarray,
    mine_ok: np.ndarray,
    ticks: np.ndarray,
    post: np.ndarray,
    nbytes: np.ndarray,
    descs: np.ndarray,
) -> dict[str, np.ndarray]:
    """A D's counters at every tick (``post``, ``nbytes``, ``descs``: its pulls' NIXL figures)."""
    mine = mine_all & c["via_p"]
    seen_t = c["d_sent"][mine_all] + c["d_queue_s"][mine_all] + c["pull"][mine_all]
    xfer_t = c["d_sent"][mine] + c["d_queue_s"][mine] + c["pull"][mine]
    failed_t = c["done"][mine_all & np.isin(c["status"], ("error", "timeout"))]
    return {
        "prompt_tokens": _cum(seen_t, ticks, c["prompt"][mine_all]),
        "prompt_tokens_external_kv_transfer": _cum(xfer_t, ticks, c["prompt"][mine]),
        # vLLM's prefix cache on D: its own blocks first, then the connector's (pulled)
        "prefix_cache_queries": _cum(seen_t, ticks, c["prompt"][mine_all]),
        "prefix_cache_hits": _cum(seen_t, ticks, c["d_local"][mine_all]),
        "external_prefix_cache_queries": _cum(xfer_t, ticks, c["prompt"][mine] - c["d_local"][mine]),
        "external_prefix_cache_hits": _cum(xfer_t, ticks, c["d_pulled"][mine]),
        "generation_tokens": _cum(c["done"][mine_ok], ticks, c["completion"][mine_ok]),
        "requests_stop": _cum(c["done"][mine_ok], ticks),
        "requests_error": _cum(failed_t, ticks),
        "nixl_xfer_time_sum": _cum(xfer_t, ticks, c["pull"][mine]),
        "nixl_xfer_time_count": _cum(xfer_t, ticks),
        "nixl_post_time_sum": _cum(xfer_t, ticks, post),
        "nixl_post_time_count": _cum(xfer_t, ticks),
        "nixl_bytes_sum": _cum(xfer_t, ticks, nbytes),
        "nixl_bytes_count": _cum(xfer_t, ticks),
        "nixl_descriptors_sum": _cum(xfer_t, ticks, descs),
        "nixl_descriptors_count": _cum(xfer_t, ticks),
        "nixl_failed_transfers": _cum(failed_t, ticks),
        "nixl_kv_expired_reqs": np.zeros(len(ticks)),
    }


def _instance_snapshots(
    spec: SeedSpec, who: tuple[str, str, str], start: float, ticks: np.ndarray, s: _Series
) -> Iterator[list[dict[str, Any]]]:
    """One instance's snapshot rows (``who``: its name, pool and role), in chunks of ``spec.chunk``."""
    name, pool, role = who
    ttft_sum = _cum(s.ttft_src[0], ticks, s.ttft_src[1])
    ttft_count = _cum(s.ttft_src[0], ticks)
    rows: list[dict[str, Any]] = []
    for k, ts in enumerate(ticks):
        row: dict[str, Any] = {
            "instance": name,
            "pool": pool,
            "role": role,
            "ts": float(ts),
            "up": True,
            "scrape_duration_s": 0.004,
            "error": None,
            "engines": 1,
            "process_start_ts": start - 3600.0,
            "kv_cache_usage": float(s.kv[k]),
            "num_running": float(s.running[k]),
            "num_waiting": float(s.waiting[k]),
            "kv_fetch_in_progress": None if s.pull_live is None else float(s.pull_live[k]),
            "ttft_sum": float(ttft_sum[k]),
            "ttft_count": float(ttft_count[k]),
            "histograms": {fam: series[k] for fam, series in s.hist.items()},
        }
        for col, values in s.counters.items():
            row[col] = float(values[k])
        rows.append(row)
        if len(rows) >= spec.chunk:
            yield rows
            rows = []
    if rows:
        yield rows


# -- controller history ------------------------------------------------------------------


def _controller_rows(spec: SeedSpec) -> dict[type, list[dict[str, Any]]]:
    start = spec.end - spec.duration_s
    degrade_ts = start + spec.degrade_at * spec.duration_s
    log = _DecisionLog(start)
    _initial_decisions(spec, log)
    if spec.degraded:
        _degraded_decisions(spec, spec.degraded, log, degrade_ts)
    return {
        Decision: log.decisions,
        WeightOverride: _overrides(spec, start),
        AuditEvent: _audit_events(spec, start),
        Alert: _alerts(spec, start, degrade_ts),
    }


@dataclass
class _DecisionLog:
    """The seeded decisions, in order (the controller's ticks are 2 s apart from ``start``)."""

    start: float
    decisions: list[dict[str, Any]] = field(default_factory=list)

    def decide(
        self,
        ts: float,
        kind: str,
        subject: str,
        fld: str,
        old: float | None,
        new: float,
        reason: str,
        message: str,
        arithmetic: str,
        inputs: dict[str, Any],
    ) -> None:
        self.decisions.append(
            {
                "ts": ts,
                "tick": int((ts - self.start) / 2.0),
                "mode": "enforce",
                "subject_kind": kind,
                "subject": subject,
                "field": fld,
                "old_value": old,
                "new_value": new,
                "reason": reason,
                "message": message,
                "arithmetic": arithmetic,
                "inputs": inputs,
                "scores": {},
                "routing_version": len(self.decisions) + 1,
            }
        )


def _initial_decisions(spec: SeedSpec, log: _DecisionLog) -> None:
    """The first tick's: each pool's limits and weight from the config, every instance at weight 1."""
    ts = log.start + 2.0
    for pool, limit in ((spec.prefill_pool, 256.0), (spec.decode_pool, 256.0)):
        # (field, value, message, arithmetic), one row a decision
        for fld, value, message, arithmetic in (
            ("max_inflight_requests", limit, "admission limit from config", f"limit = config {limit:g}"),
            ("max_inflight_kv_bytes", 64 * 2**30, "handoff KV budget from config", "budget = config 64 GiB"),
            ("weight", 1.0, "pool weight from config", "w = 1.0"),
        ):
            log.decide(ts, "pool", pool, fld, None, value, "Initial", message, arithmetic, {})
    for name in {n: 1.0 for n in (*spec.prefill, *spec.decode)}:
        log.decide(
            ts, "instance", name, "weight", None, 1.0, "Initial", "all instances healthy", "w = 1.0", {}
        )


def _degraded_decisions(spec: SeedSpec, degraded: str, log: _DecisionLog, degrade_ts: float) -> None:
    """The degraded D's weight stepped down to 0.25, then the decode pool's KV budget cut."""
    ts = degrade_ts + 20.0
    w = 1.0
    tick = 0
    while w > 0.25 + 1e-9:
        new = max(w - 0.25, 0.25)
        handoff_ms = 2400.0 + 200 * tick
        log.decide(
            ts,
            "instance",
            degraded,
            "weight",
            w,
            new,
            "NixlSlowTransfers",
            f"{degraded}: mean NIXL xfer {handoff_ms:.0f} ms vs pool median 25 ms",
            f"w = max({w:.2f} - step 0.25, target 0.25) = {new:.2f}",
            {"nixl_xfer_mean_ms": handoff_ms, "pool_median_ms": 25.0},
        )
        w, ts, tick = new, ts + 10.0, tick + 1
    log.decide(
        ts + 5.0,
        "pool",
        spec.decode_pool,
        "max_inflight_kv_bytes",
        64 * 2**30,
        48 * 2**30,
        "HandoffBacklog",
        "KV bytes in flight to D above 75% of budget",
        "budget = 64 GiB * 0.75 = 48 GiB",
        {"inflight_kv_bytes": 52 * 2**30},
    )


def _overrides(spec: SeedSpec, start: float) -> list[dict[str, Any]]:
    """A drain of the last P (cleared) and a weight canary on the first D (live)."""
    return [
        {
            "id": 1,
            "subject_kind": "instance",
            "subject": spec.prefill[-1],
            "weight": None,
            "drained": True,
            "reason": "kernel upgrade",
            "actor": "alice",
            "created": start + 60.0,
            "expires": start + 600.0,
            "cleared": start + 420.0,
        },
        {
            "id": 2,
            "subject_kind": "instance",
            "subject": spec.decode[0],
            "weight": 0.8,
            "drained": False,
            "reason": "canary: new NIC firmware",
            "actor": "bob",
            "created": spec.end - 300.0,
            "expires": spec.end + 3300.0,
            "cleared": None,
        },
    ]


def _audit_events(spec: SeedSpec, start: float) -> list[dict[str, Any]]:
    """The operators' actions behind the overrides."""
    return [
        {
            "ts": start + 60.0,
            "actor": "alice",
            "action": "instance.drain",
            "subject": spec.prefill[-1],
            "before": {"drained": False},
            "after": {"drained": True},
            "reason": "kernel upgrade",
            "override_id": 1,
        },
        {
            "ts": start + 420.0,
            "actor": "alice",
            "action": "instance.undrain",
            "subject": spec.prefill[-1],
            "before": {"drained": True},
            "after": {"drained": False},
            "reason": "upgrade done",
            "override_id": 1,
        },
        {
            "ts": spec.end - 300.0,
            "actor": "bob",
            "action": "instance.weight",
            "subject": spec.decode[0],
            "before": {"weight": 1.0},
            "after": {"weight": 0.8, "ttl_s": 3600},
            "reason": "canary: new NIC firmware",
            "override_id": 2,
        },
    ]


def _alerts(spec: SeedSpec, start: float, degrade_ts: float) -> list[dict[str, Any]]:
    """The drained P's InstanceDown (resolved); with a degraded D, its NIXL and TTFT alerts (firing)."""
    alerts = [
        {
            "rule": "InstanceDown",
            "fingerprint": "a1",
            "state": "resolved",
            "severity": "critical",
            "labels": {"instance": spec.prefill[-1]},
            "annotations": {"summary": "scrape failed"},
            "value": 0.0,
            "active_since": start + 65.0,
            "fired_at": start + 95.0,
            "resolved_at": start + 430.0,
            "last_eval": start + 430.0,
        },
    ]
    if spec.degraded:
        alerts += [
            {
                "rule": "NixlTransferSlow",
                "fingerprint": "b2",
                "state": "firing",
                "severity": "warning",
                "labels": {"instance": spec.degraded, "pool": spec.decode_pool},
                "annotations": {"summary": f"NIXL pulls on {spec.degraded} take >1 s"},
                "value": 2.6,
                "active_since": degrade_ts + 15.0,
                "fired_at": degrade_ts + 45.0,
                "resolved_at": None,
                "last_eval": spec.end,
            },
            {
                "rule": "TTFTSLOBurn",
                "fingerprint": "c3",
                "state": "firing",
                "severity": "critical",
                "labels": {"pool": spec.decode_pool},
                "annotations": {"summary": "TTFT p99 above 2000 ms"},
                "value": 0.86,
                "active_since": degrade_ts + 30.0,
                "fired_at": degrade_ts + 90.0,
                "resolved_at": None,
                "last_eval": spec.end,
            },
        ]
    return alerts


def _instance_rows(spec: SeedSpec, start: float) -> list[dict[str, Any]]:
    return [
        {
            "name": n,
            "pool": spec.prefill_pool if role == "prefill" else spec.decode_pool,
            "role": role,
            "url": f"http://127.0.0.1:{18100 + i if role == 'prefill' else 18200 + i}",
            "metrics_url": None,
            "labels": {"gpu": "sim"},
            "engine_id": None,
            "first_seen": start,
            "last_seen": spec.end,
        }
        for role, names in (("prefill", spec.prefill), ("decode", spec.decode))
        for i, n in enumerate(names)
    ]


_CONTROLLER_MODELS: tuple[type, ...] = (Decision, WeightOverride, AuditEvent, Alert)


def _seed(engine: Engine, spec: SeedSpec) -> SeedSummary:
    rng = np.random.default_rng(spec.seed)
    req = _gen_requests(spec, rng)
    start = spec.end - spec.duration_s
    n_snap = 0
    with engine.begin() as conn:
        conn.execute(insert(InstanceRow), _instance_rows(spec, start))
        for rows in _request_rows(spec, req, rng):
            conn.execute(insert(RequestRecord), rows)
        for rows in _snapshot_rows(spec, req, rng):
            conn.execute(insert(Snapshot), rows)
            n_snap += len(rows)
        ctrl = _controller_rows(spec) if spec.controller_history else {m: [] for m in _CONTROLLER_MODELS}
        for model in _CONTROLLER_MODELS:
            if ctrl[model]:
                conn.execute(insert(model), ctrl[model])
    return _summary(spec, req, n_snap, len(ctrl[Decision]))


def _summary(spec: SeedSpec, req: _Requests, n_snap: int, n_decisions: int) -> SeedSummary:
    c = req.cols
    ok = c["status"] == "ok"
    slow = int(np.nanargmax(np.where(ok, c["ttft_s"], -1.0))) if ok.any() else None
    lease = np.flatnonzero(c["lease"])
    statuses, counts = np.unique(c["status"].astype(str), return_counts=True)
    return SeedSummary(
        requests=req.n,
        snapshots=n_snap,
        decisions=n_decisions,
        start=spec.end - spec.duration_s,
        end=spec.end,
        degraded=spec.degraded,
        slow_request_id=None if slow is None else request_id(slow, spec.seed),
        lease_expiry_request_id=request_id(int(lease[-1]), spec.seed) if lease.size else None,
        counts={str(s): int(k) for s, k in zip(statuses, counts, strict=True)},
    )


# -- bulk load (PostgreSQL COPY) -------------------------------------------------------------

# The tables the bulk load fills with COPY; their indexes and keys are built after the load.
_BULK_TABLES = ("request_records", "snapshots")


def _nullable(values: np.ndarray, keep: np.ndarray) -> Any:
    """An Arrow array of ``values`` with nulls where ``keep`` is False."""
    import pyarrow as pa

    return pa.array(values, mask=~keep)


def _arrow_floats(a: np.ndarray) -> Any:
    """A float column as an Arrow array, NaN as null."""
    import pyarrow as pa

    return pa.array(a.astype(float), mask=np.isnan(a.astype(float)))


def _request_table(spec: SeedSpec, req: _Requests, lo: int, hi: int) -> Any:
    """Request records ``lo``..``hi`` as an Arrow table: the same values :func:`_request_rows` builds
    row by row (ids ``lo + 1``.. as the insert path gets them), column-wise for COPY."""
    import pyarrow as pa

    c = req.cols
    sl = slice(lo, hi)
    status = c["status"][sl].astype(str)
    ok = status == "ok"
    served = ~c["rejected"][sl]
    via_p = served & c["via_p"][sl]
    ttft, tpot = c["ttft_s"][sl], c["tpot_s"][sl]
    prompt = c["prompt"][sl]
    http = c["http"][sl]
    prefill = np.array(spec.prefill, dtype=object)[c["p_idx"][sl]]
    decode = np.array(spec.decode, dtype=object)[c["d_idx"][sl]]
    plain_error = np.isin(status, ("ok", "client_disconnect"))
    cols: dict[str, Any] = {
        "id": pa.array(np.arange(lo, hi) + 1, type=pa.int64()),
        **{name: pa.array(values) for name, values in _id_columns(spec, lo, hi).items()},
        "p_instance": _nullable(prefill, via_p),
        "d_instance": _nullable(decode, served),
        "p_pool": _nullable(np.full(hi - lo, spec.prefill_pool, dtype=object), via_p),
        "d_pool": _nullable(np.full(hi - lo, spec.decode_pool, dtype=object), served),
        "status": pa.array(status),
        "http_status": pa.array(http.astype(np.int64)),
        "error": _nullable(np.char.add("http ", http.astype(str)), ~plain_error),
        "retries": pa.array(np.zeros(hi - lo, dtype=np.int64)),
        "prompt_tokens": pa.array(prompt.astype(np.int64)),
        "completion_tokens": pa.array(c["completion"][sl].astype(np.int64)),
        "kv_blocks": _nullable((prompt + 15) // 16, via_p),
        "kv_bytes": _nullable(c["kv_bytes"][sl].astype(np.int64), via_p),
        "route_path": pa.array(_route_paths(c, sl).tolist(), type=pa.string()),
        "prefix_key": pa.array(_prefix_keys(c, sl, spec.seed), type=pa.string()),
        **{col: _nullable(c[key][sl], c[key][sl] >= 0) for col, key in ROUTING_INT_COLUMNS.items()},
        "d_decode_s": _arrow_floats(np.where(ok, c["d_decode_s"][sl], np.nan)),
        "ttft_s": _arrow_floats(ttft),
        "tpot_s": _arrow_floats(tpot),
        "slo_ttft_met": _nullable(ttft <= spec.ttft_target_s, ~np.isnan(ttft)),
        "slo_tpot_met": _nullable(tpot <= spec.tpot_target_s, ~np.isnan(tpot)),
        "slo_met": _nullable((ttft <= spec.ttft_target_s) & ~(tpot > spec.tpot_target_s), ok),
        "lease_expiry_suspect": pa.array(c["lease"][sl].astype(bool)),
        "attributes": pa.array(np.full(hi - lo, "{}", dtype=object)),
    }
    for name in _FLOAT_COLUMNS:
        cols[name] = _arrow_floats(c[name][sl])
    return pa.table(cols)


def _snapshot_table(rows: list[dict[str, Any]], first_id: int) -> Any:
    """Snapshot rows (as :func:`_snapshot_rows` yields them) as an Arrow table for COPY."""
    import json

    import pyarrow as pa

    for k, row in enumerate(rows):
        row["id"] = first_id + k
        row["histograms"] = json.dumps(row["histograms"], separators=(",", ":"))
        row["extra"] = "{}"
    return pa.Table.from_pylist(rows)


def _copy_table(cursor: Any, table: str, data: Any) -> None:
    """COPY an Arrow table into ``table`` (CSV: an unquoted empty field is NULL)."""
    import io

    import pyarrow.csv as pacsv

    buf = io.BytesIO()
    pacsv.write_csv(data, buf, pacsv.WriteOptions(include_header=False))
    columns = ", ".join(f'"{c}"' for c in data.column_names)
    with cursor.copy(f"COPY {table} ({columns}) FROM STDIN WITH (FORMAT csv)") as copy:
        copy.write(buf.getbuffer())


def _drop_keys_and_indexes(cursor: Any, table: str) -> list[str]:
    """Drop ``table``'s indexes, primary key and unique constraints; return the DDL that rebuilds them."""
    cursor.execute(
        "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE conrelid = %s::regclass AND contype IN ('p', 'u')",
        (table,),
    )
    constraints = cursor.fetchall()
    cursor.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s", (table,))
    named = {name for name, _ in constraints}
    indexes = [(name, ddl) for name, ddl in cursor.fetchall() if name not in named]
    for name, _ in indexes:
        cursor.execute(f'DROP INDEX "{name}"')
    for name, _ in constraints:
        cursor.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{name}"')
    return [f'ALTER TABLE {table} ADD CONSTRAINT "{n}" {d}' for n, d in constraints] + [d for _, d in indexes]


def _renice_backend(cursor: Any, nice: int) -> str:
    """Lower the priority of this connection's server process (when it runs on this host as a
    user we may renice); parallel maintenance workers are turned off, as they would not be."""
    import os

    cursor.execute("SET max_parallel_maintenance_workers = 0")
    cursor.execute("SELECT pg_backend_pid()")
    pid = int(cursor.fetchone()[0])
    try:
        os.setpriority(os.PRIO_PROCESS, pid, max(os.getpriority(os.PRIO_PROCESS, pid), nice))
    except OSError as exc:
        return f"server process {pid} not reniced ({exc})"
    return f"server process {pid} reniced to {nice}"


def bulk_seed_postgres(
    url: str,
    spec: SeedSpec,
    *,
    progress: Callable[[str], None] | None = None,
    backend_nice: int | None = None,
) -> SeedSummary:
    """:func:`seed_store` for a large history on PostgreSQL: the same rows, loaded with COPY in
    chunks into tables without indexes, which are built after the load; then VACUUM ANALYZE.
    The store is migrated first and must hold no request records or snapshots yet. With
    ``backend_nice``, the server process doing the load runs at that niceness too."""
    upgrade(url)
    engine = make_engine(url)
    load = _BulkLoad(progress or (lambda _msg: None), backend_nice, time.perf_counter())
    try:
        rng = np.random.default_rng(spec.seed)
        req = _gen_requests(spec, rng)
        load.say(f"generated {req.n:,} requests in {load.elapsed()}")
        ctrl = _controller_rows(spec)
        start = spec.end - spec.duration_s
        with engine.begin() as conn:
            conn.execute(insert(InstanceRow), _instance_rows(spec, start))
            for model in (Decision, WeightOverride, AuditEvent, Alert):
                if ctrl[model]:
                    conn.execute(insert(model), ctrl[model])
        raw = engine.raw_connection()
        try:
            n_snap = load.copy(raw.cursor(), spec, req, rng)
            raw.commit()
        finally:
            raw.close()
        load.vacuum(engine)
    finally:
        engine.dispose()
    return _summary(spec, req, n_snap, len(ctrl[Decision]))


@dataclass(frozen=True)
class _BulkLoad:
    """One bulk load's progress reports (``say``, with the seconds since ``t0``) and server niceness."""

    say: Callable[[str], None]
    backend_nice: int | None
    t0: float

    def elapsed(self) -> str:
        return f"{time.perf_counter() - self.t0:.0f} s"

    def copy(self, cur: Any, spec: SeedSpec, req: _Requests, rng: np.random.Generator) -> int:
        """COPY the request records and snapshots into their tables without keys or indexes, then
        rebuild those and the id sequences; returns the number of snapshots."""
        cur.execute("SET maintenance_work_mem = '256MB'")
        if self.backend_nice is not None:
            self.say(_renice_backend(cur, self.backend_nice))
        rebuild = [ddl for t in _BULK_TABLES for ddl in _drop_keys_and_indexes(cur, t)]
        chunk = max(spec.chunk, 100_000)
        for lo in range(0, req.n, chunk):
            hi = min(lo + chunk, req.n)
            _copy_table(cur, "request_records", _request_table(spec, req, lo, hi))
            self.say(f"requests {hi:,} / {req.n:,} ({hi / max(req.n, 1):.0%}) {self.elapsed()}")
        n_snap = 0
        for rows in _snapshot_rows(spec, req, rng):
            _copy_table(cur, "snapshots", _snapshot_table(rows, n_snap + 1))
            n_snap += len(rows)
            self.say(f"snapshots {n_snap:,} {self.elapsed()}")
        for ddl in rebuild:
            self.say(f"{ddl[:100]} ... {self.elapsed()}")
            cur.execute(ddl)
        for t in _BULK_TABLES:
            cur.execute(f"SELECT setval(pg_get_serial_sequence('{t}', 'id'), (SELECT max(id) FROM {t}))")
        return n_snap

    def vacuum(self, engine: Engine) -> None:
        """VACUUM ANALYZE the loaded tables (outside a transaction)."""
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            self.say(f"VACUUM ANALYZE ... {self.elapsed()}")
            if self.backend_nice is not None:
                _renice_backend(conn.connection.dbapi_connection.cursor(), self.backend_nice)  # type: ignore[union-attr]
            for t in (*_BULK_TABLES, "decisions", "instances"):
                conn.exec_driver_sql(f"VACUUM ANALYZE {t}")
