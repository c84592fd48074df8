"""Frames the pages show, computed from query results: per-instance health, NIXL figures
per decode instance, and counter rates between consecutive scrapes.

Pure pandas over already-fetched frames (no I/O, no Streamlit), so tests feed them
small hand-made frames.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from analysis.blame import Cell, Factorization, factor
from analysis.stranded import holds_while_idle, pending_total, to_pull
from dashboard.derive import find_histogram, histogram_increase, histogram_quantile, ratio
from pdscope.stats import percentile


def attribute_frame(
    items: Iterable[Any],
    columns: Sequence[str],
    computed: Mapping[str, Callable[[Any], object]] | None = None,
) -> pd.DataFrame:
    """One row per item: each of ``columns`` is the item's attribute of that name, or
    ``computed[column](item)`` where ``computed`` has the column."""
    made = computed or {}
    rows = [{c: made[c](x) if c in made else getattr(x, c) for c in columns} for x in items]
    return pd.DataFrame(rows, columns=list(columns))


def counter_totals(
    series: pd.DataFrame, counters: Sequence[str], by: Sequence[str] = ("instance",)
) -> pd.DataFrame:
    """Per ``by`` group of the rows with an instance: each counter's increase over the frame, the sum of its
    steps (:func:`counter_increases`: ``pdscope.stats.counter_increase``'s rule); NaN where the group's
    counter has no step (fewer than two values present) or the frame has no such counter."""
    if series.empty or not set(by) <= set(series.columns):
        return pd.DataFrame(columns=list(counters), dtype=float)
    keys = series.dropna(subset=list(by)).groupby(list(by), sort=True).size().index
    present = [c for c in counters if c in series]
    if not present:
        return pd.DataFrame(np.nan, index=keys, columns=list(counters))
    steps = counter_increases(series, present).groupby(list(by), sort=True)[present].sum(min_count=1)
    return steps.reindex(index=keys, columns=list(counters))


def _total(totals: pd.DataFrame, key: object, column: str) -> float:
    return float(totals.at[key, column]) if key in totals.index else float("nan")


def _quantiles_ms(edges: tuple[Any, Any] | None, family: str, qs: tuple[float, ...]) -> list[float | None]:
    if edges is None:
        return [None for _ in qs]
    inc = histogram_increase(find_histogram(edges[0], family), find_histogram(edges[1], family))
    out: list[float | None] = []
    for q in qs:
        v = histogram_quantile(q, inc)
        out.append(None if v is None else v * 1000.0)
    return out


_HEALTH_COUNTERS = (
    "nixl_xfer_time_sum",
    "nixl_xfer_time_count",
    "nixl_failed_transfers",
    "nixl_kv_expired_reqs",
)
# nixl_per_instance's, in the order it unpacks them
_NIXL_COUNTERS = (
    "nixl_xfer_time_count",
    "nixl_xfer_time_sum",
    "nixl_post_time_sum",
    "nixl_post_time_count",
    "nixl_bytes_sum",
    "nixl_descriptors_sum",
    "nixl_failed_transfers",
    "nixl_kv_expired_reqs",
)


def instance_health(
    series: pd.DataFrame,
    latest: pd.DataFrame,
    edges: Mapping[str, tuple[Any, Any]],
    weights: pd.DataFrame,
) -> pd.DataFrame:
    """One row per instance: up, weight, KV usage, running/waiting now, TTFT/ITL p50/p99 over
    the window (from vLLM's histograms), NIXL mean transfer time, failures and lease expiries.
    """
    weight_of = dict(zip(weights["subject"], weights["weight"], strict=False)) if not weights.empty else {}
    rows = []
    totals = counter_totals(series, _HEALTH_COUNTERS)
    for _, snap in latest.iterrows():
        name = snap["instance"]
        ttft50, ttft99 = _quantiles_ms(edges.get(name), "ttft", (0.5, 0.99))
        itl50, itl99 = _quantiles_ms(edges.get(name), "itl", (0.5, 0.99))
        xfer = ratio(_total(totals, name, "nixl_xfer_time_sum"), _total(totals, name, "nixl_xfer_time_count"))
        rows.append(
            {
                "instance": name,
                "pool": snap["pool"],
                "role": snap["role"],
                "up": bool(snap["up"]),
                "weight": weight_of.get(name),
                "kv_cache_usage_pct": None
                if pd.isna(snap["kv_cache_usage"])
                else 100.0 * float(snap["kv_cache_usage"]),
                "running": snap["num_running"],
                "waiting": snap["num_waiting"],
                "ttft_p50_ms": ttft50,
                "ttft_p99_ms": ttft99,
                "itl_p50_ms": itl50,
                "itl_p99_ms": itl99,
                "nixl_xfer_mean_ms": None if xfer is None or np.isnan(xfer) else xfer * 1000.0,
                "nixl_failed": _total(totals, name, "nixl_failed_transfers"),
                "expired_leases": _total(totals, name, "nixl_kv_expired_reqs"),
                "last_scrape": snap["ts"],
            }
        )
    return pd.DataFrame(rows)


def pool_totals(health: pd.DataFrame) -> pd.DataFrame:
    """Per pool: instances up/total, running, waiting, mean KV usage."""
    if health.empty:
        return pd.DataFrame(
            columns=["pool", "role", "up", "instances", "running", "waiting", "kv_cache_usage_pct"]
        )
    grouped = health.groupby(["pool", "role"], as_index=False).agg(
        up=("up", "sum"),
        instances=("instance", "count"),
        running=("running", "sum"),
        waiting=("waiting", "sum"),
        kv_cache_usage_pct=("kv_cache_usage_pct", "mean"),
    )
    return grouped


def nixl_per_instance(series: pd.DataFrame, edges: Mapping[str, tuple[Any, Any]]) -> pd.DataFrame:
    """NIXL figures over the window per instance that transferred or expired anything.

    In pull mode D records transfers and failures; P records lease expiries. MB/s is bytes
    moved per second of transfer time (the link's effective rate while busy).
    """
    rows = []
    if series.empty:
        return pd.DataFrame()
    totals = counter_totals(series, _NIXL_COUNTERS, by=("instance", "role"))
    for (name, role), got in totals.iterrows():
        transfers, xfer_s, post_s, posts, nbytes, descs, failed, expired = (float(v) for v in got)
        if not any(v > 0 for v in (transfers, failed, expired) if not np.isnan(v)):
            continue
        x50, x90, x99 = _quantiles_ms(edges.get(name), "nixl_xfer_time", (0.5, 0.9, 0.99))
        p50, p99 = _quantiles_ms(edges.get(name), "nixl_post_time", (0.5, 0.99))
        mean_xfer = ratio(xfer_s, transfers)
        mean_post = ratio(post_s, posts)
        per_xfer_bytes = ratio(nbytes, transfers)
        rate = ratio(nbytes, xfer_s)
        rows.append(
            {
                "instance": name,
                "role": role,
                "transfers": transfers,
                "xfer_mean_ms": None if mean_xfer is None else mean_xfer * 1000.0,
                "xfer_p50_ms": x50,
                "xfer_p90_ms": x90,
                "xfer_p99_ms": x99,
                "post_mean_ms": None if mean_post is None else mean_post * 1000.0,
                "post_p50_ms": p50,
                "post_p99_ms": p99,
                "MB_per_s": None if rate is None else rate / 1e6,
                "MB_per_transfer": None if per_xfer_bytes is None else per_xfer_bytes / 1e6,
                "descriptors_per_transfer": ratio(descs, transfers),
                "failed_transfers": failed,
                "expired_leases": expired,
            }
        )
    return pd.DataFrame(rows)


def _held_since(mine: pd.DataFrame) -> float | None:
    """The first scrape of an instance's trailing run (through its newest scrape) of up scrapes that found it
    idle (nothing running or waiting) with KV in use; None when its newest scrape is not one."""
    since = None
    for row in mine.sort_values("ts", ascending=False).itertuples(index=False):
        if not holds_while_idle(row.up, row.kv_cache_usage, row.num_running, row.num_waiting):
            break
        since = float(row.ts)
    return since


def _pulls_pending(series: pd.DataFrame) -> float | None:
    """Requests every up D still has to pull (KV-fetch stages waiting_to_start + in_progress), at each D's
    newest scrape; None where a D's gauges are missing."""
    ds = series[series["role"] == "decode"]
    lasts = [mine.sort_values("ts").iloc[-1] for _, mine in ds.groupby("instance", sort=False)]
    return pending_total(
        to_pull(_num(last.get("kv_fetch_waiting_to_start")), _num(last.get("kv_fetch_in_progress")))
        for last in lasts
        if last["up"]
    )


def _num(v: object) -> float | None:
    return None if v is None or pd.isna(v) else float(v)  # type: ignore[arg-type]


def stranded_kv(series: pd.DataFrame, sample: pd.DataFrame, step: int) -> tuple[pd.DataFrame, float | None]:
    """Per P: the KV it holds at its newest scrape while idle (the ``StrandedKV`` alert's condition on P's
    side) and for how long, and the window's handoffs it prefilled that no D served (P done, no first
    token; the sample's count times ``step``); and the requests the up Ds still have to pull (the rule's
    other side: it holds only at 0)."""
    if series.empty:
        return pd.DataFrame(), None
    end = float(series["ts"].max())
    served = sample if not sample.empty else pd.DataFrame(columns=["p_instance", "p_done", "first_token"])
    unserved = served[served["p_done"].notna() & served["first_token"].isna()]
    counts = unserved.groupby("p_instance").size() if not unserved.empty else pd.Series(dtype=int)
    rows = []
    for name, mine in series[series["role"] == "prefill"].groupby("instance", sort=True):
        since = _held_since(mine)
        last = mine.sort_values("ts").iloc[-1]
        rows.append(
            {
                "instance": name,
                "held_while_idle_pct": None if since is None else 100.0 * float(last["kv_cache_usage"]),
                "held_for_s": None if since is None else end - since,
                "unserved_handoffs": int(counts.get(name, 0)) * max(1, step),
            }
        )
    return pd.DataFrame(rows), _pulls_pending(series)


def avoided_pairs(table: Mapping[str, Any] | None, now: float) -> pd.DataFrame:
    """The P x D pairs the routing table leaves out (``avoid_pairs``): each pair, why (a D's stale agent
    for a restarted P, or an incompatible pair), for how long and the controller's sentence; empty when
    none (or no table). Malformed entries are left out."""
    rows = []
    for pr in (table or {}).get("avoid_pairs") or []:
        if not isinstance(pr, dict) or not all(isinstance(pr.get(k), str) for k in ("prefill", "decode")):
            continue
        since = pr.get("since")
        rows.append(
            {
                "prefill": pr["prefill"],
                "decode": pr["decode"],
                "reason": str(pr.get("reason") or ""),
                "for_s": max(0.0, now - since) if isinstance(since, int | float) else None,
                "why": str(pr.get("text") or ""),
            }
        )
    return pd.DataFrame(rows, columns=["prefill", "decode", "reason", "for_s", "why"])


def _by_instance(series: pd.DataFrame) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """``series``' rows with an instance, in order of their instances' first rows, each instance's by time
    (ties in row order), on a fresh index; with each row's instance key and whether the row follows one
    of its instance's (the first has no interval). By position: a frame's index may repeat labels."""
    codes = pd.factorize(series["instance"])[0]  # -1: no instance
    order = np.lexsort((series["ts"].to_numpy(), codes))  # stable
    order = order[codes[order] >= 0]
    key = codes[order]
    follows = np.zeros(len(key), dtype=bool)
    follows[1:] = key[1:] == key[:-1]
    return series.iloc[order].reset_index(drop=True), key, follows


def counter_increases(
    series: pd.DataFrame, counters: Iterable[str], per_second: bool = False
) -> pd.DataFrame:
    """Per instance (in order of its first row) and scrape after its first, by time: each counter's
    increase since the instance's last scrape that had it (a fall is a restart: the new value is the
    increase), or with ``per_second`` that increase over the seconds between the two; beside the
    scrape's ``ts``, ``instance`` and (where the frame has it) ``role``. A missing or non-finite value
    (a failed scrape) has no increase, and the next value counts from the last one present:
    ``pdscope.stats.counter_increase``'s rule, step by step."""
    mine, key, follows = _by_instance(series)
    out = mine[[c for c in ("ts", "instance", "role") if c in mine]].copy()
    ts = mine["ts"].astype(float)
    for col in counters:
        values = pd.to_numeric(mine[col], errors="coerce").astype(float)
        present = values.where(np.isfinite(values))
        if present.notna().all():
            prev, prev_ts = present.groupby(key).shift(), ts.groupby(key).shift()
        else:
            prev = present.groupby(key).ffill().groupby(key).shift()
            prev_ts = ts.where(present.notna()).groupby(key).ffill().groupby(key).shift()
        delta = present - prev
        step = delta.where(~(delta < 0), present)
        if per_second:  # two scrapes at one time have no interval: no rate, not an infinite one
            dt = ts - prev_ts
            step = step / dt.where(dt > 0)
        out[col] = step
    return out[follows].reset_index(drop=True)


def interval_rates(series: pd.DataFrame, counters: tuple[str, ...]) -> pd.DataFrame:
    """Per instance and scrape: each counter's rate per second since the instance's last scrape that had it.

    A counter that went down (a restart) counts from zero; the first scrape has no rate, nor has a
    failed one (:func:`counter_increases`).
    """
    if series.empty:
        return pd.DataFrame(columns=["ts", "instance", "role", *counters])
    return counter_increases(series, counters, per_second=True)


def rate_per_instance(rates: pd.DataFrame, role: str, column: str) -> pd.DataFrame:
    """Per instance of ``role``: the mean, p95 and peak of a rate column of :func:`interval_rates`
    (empty without such an instance)."""
    mine = rates[rates["role"] == role] if not rates.empty else rates
    if mine.empty:
        return pd.DataFrame()
    return (
        mine.groupby("instance")[column]
        .agg(mean="mean", p95=lambda s: percentile_of(s, 95), peak="max")
        .reset_index()
    )


def interval_means(series: pd.DataFrame, sum_col: str, count_col: str, scale: float = 1.0) -> pd.DataFrame:
    """Per instance and scrape: Δsum/Δcount since the instance's last scrape that had both (e.g. mean
    xfer time); a restart counts from zero (:func:`counter_increases`), an interval without a count
    has no mean."""
    if series.empty:
        return pd.DataFrame(columns=["ts", "instance", "value"])
    both = np.ones(len(series), dtype=bool)
    for col in (sum_col, count_col):
        both &= np.isfinite(pd.to_numeric(series[col], errors="coerce").to_numpy(dtype=float))
    steps = counter_increases(series[both], (sum_col, count_col))
    value = steps[sum_col] / steps[count_col].where(steps[count_col] > 0) * scale
    out = pd.DataFrame({"ts": steps["ts"], "instance": steps["instance"], "value": value}).dropna()
    return out.reset_index(drop=True)


def percentile_of(values: pd.Series, q: float) -> float:
    """``pdscope.stats.percentile`` (``q`` in 0..100) of a series' finite values; NaN when it
    has none (pandas' missing value, so it fits a frame cell)."""
    arr = values.to_numpy(dtype=float)
    v = percentile(arr[np.isfinite(arr)].tolist(), q)
    return math.nan if v is None else v


def _or_none(v: float) -> float | None:
    return None if math.isnan(v) else v


def percentiles_ms(values: pd.Series, qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict[str, float | None]:
    """Percentiles (``pdscope.stats``) of a seconds series, in ms, keyed "p50", "p90", ..."""
    out: dict[str, float | None] = {}
    for q in qs:
        v = _or_none(percentile_of(values, q * 100.0))
        out[f"p{round(q * 100, 1):g}"] = None if v is None else v * 1000.0
    return out


def slo_figures(sample: pd.DataFrame, buckets: pd.DataFrame, seconds: float) -> dict[str, Any] | None:
    """The window's SLO headline, with ``store.queries.slo_summary``'s definitions:
    attainment = met every SLO / completed (status ok); goodput = met / window seconds.

    Counts come from the exact per-bucket counts; percentiles from the (maybe sampled)
    per-request frame. None when the window holds no request.
    """
    if buckets.empty or int(buckets["arrivals"].sum()) == 0:
        return None
    completed = int(buckets["completed"].sum())
    met = int(buckets["met"].sum())
    ok = sample[sample["status"] == "ok"] if not sample.empty else sample

    def q(col: str, p: float) -> float | None:
        return None if ok.empty else _or_none(percentile_of(ok[col], p * 100.0))

    return {
        "requests": int(buckets["arrivals"].sum()),
        "completed": completed,
        "slo_met": met,
        "attainment": met / completed if completed else None,
        "goodput_per_s": met / max(seconds, 1e-9),
        "ttft_p50_s": q("ttft_s", 0.5),
        "ttft_p99_s": q("ttft_s", 0.99),
        "tpot_p99_s": q("tpot_s", 0.99),
        "e2e_p99_s": q("e2e_s", 0.99),
    }


def handoff_by(sample: pd.DataFrame, by: str = "pair") -> pd.DataFrame:
    """Handoff time (P done → D first token) per (P, D) pair, per D or per P, in ms:
    requests, p50, p90, p99, mean and lease-expiry suspects (as ``store.queries.handoff_stats``)."""
    cols = [
        "key",
        "p_instance",
        "d_instance",
        "requests",
        "p50_ms",
        "p90_ms",
        "p99_ms",
        "mean_ms",
        "lease_suspects",
    ]
    if sample.empty:
        return pd.DataFrame(columns=cols)
    df = sample.dropna(subset=["p_done", "first_token"]).copy()
    if df.empty:
        return pd.DataFrame(columns=cols)
    df["handoff_ms"] = (df["first_token"] - df["p_done"]).clip(lower=0.0) * 1000.0
    df["suspect"] = df["lease_expiry_suspect"].fillna(False).astype(bool).astype(int)
    keys = {"pair": ["p_instance", "d_instance"], "d_instance": ["d_instance"], "p_instance": ["p_instance"]}[
        by
    ]
    g = df.groupby(keys, dropna=False)["handoff_ms"]
    out = pd.DataFrame(
        {
            "requests": g.size(),
            **{f"p{q}_ms": g.agg(lambda s, q=q: percentile_of(s, q)) for q in (50, 90, 99)},
            "mean_ms": g.mean(),
            "lease_suspects": df.groupby(keys, dropna=False)["suspect"].sum(),
        }
    ).reset_index()
    for k in ("p_instance", "d_instance"):
        if k not in out:
            out[k] = ""
    out["key"] = (
        out["p_instance"].astype(str) + "->" + out["d_instance"].astype(str)
        if by == "pair"
        else out[keys[0]].astype(str)
    )
    return out[cols]


def handoff_effects(pairs: pd.DataFrame, min_samples: int = 5) -> tuple[pd.DataFrame, Factorization]:
    """The pairs' median handoffs (``handoff_by(.., "pair")``) factored as the controller factors them
    (:func:`analysis.blame.factor`): a row per P and D with its effect (× the typical pair), the pairs it
    stands on and whether the matrix judges it; and the factorization (its blames and notes)."""
    cells = {
        (str(r.p_instance), str(r.d_instance)): Cell(float(r.p50_ms) / 1000.0, int(r.requests))
        for r in pairs.itertuples()
        if r.p_instance and r.d_instance and pd.notna(r.p50_ms)
    }
    ps = sorted({p for p, _ in cells})
    ds = sorted({d for _, d in cells})
    fit = factor(cells, ps, ds)
    blamed = {(b.side, b.name) for b in fit.blames}
    rows = [
        {
            "side": side[0].upper(),
            "instance": e.name,
            "effect_x": e.ratio,
            "pairs": e.cells,
            "judged": e.judged,
            "blamed": (side, e.name) in blamed,
        }
        for side, effects in (("prefill", fit.prefill), ("decode", fit.decode))
        for e in effects.values()
    ]
    out = pd.DataFrame(rows, columns=["side", "instance", "effect_x", "pairs", "judged", "blamed"])
    return out, fit


def buckets_from_sample(sample: pd.DataFrame, step: int, start: float, width_s: float) -> pd.DataFrame:
    """``records.slo_buckets`` estimated from every ``step``-th request (counts scaled by
    ``step``), for ranges too large to count row by row within a second. (No per-SLO
    miss counts: the sample does not carry them.)"""
    cols = ["arrivals", "completed", "met", "errors", "rejected"]
    if sample.empty:
        return pd.DataFrame(columns=[*cols, "t"])
    b = ((sample["proxy_in"] - start) // width_s).astype(int)
    status = sample["status"]
    flags = pd.DataFrame(
        {
            "arrivals": 1,
            "completed": (status == "ok").astype(int),
            "met": sample["slo_met"].fillna(False).astype(bool).astype(int),
            "errors": status.isin(("error", "timeout")).astype(int),
            "rejected": (status == "rejected").astype(int),
        }
    )
    out = (flags.groupby(b).sum() * step).reset_index(names="b")
    out["t"] = start + out["b"].astype(float) * width_s
    return out.drop(columns=["b"])
