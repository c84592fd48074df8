"""Frames the Prefix cache page shows: vLLM's own prefix-cache hit rates per instance over time,
the KV-aware router's predicted cached tokens against what vLLM reported it reused, the hottest
prefixes, and the share of requests served without P.

Hit rates come from the snapshots' cumulative counters (``prefix_cache_hits / prefix_cache_queries``
and, on D, the KV connector's ``external_prefix_cache_*``), as increases per time bucket with
restarts counted from zero (``dashboard.summaries.counter_increases``). The rest comes from a
window sample of request records (every k-th by id, ``step`` = k): counts and token sums are scaled
back up by k, ratios are not.

Predicted against reported is compared like for like: on P, over the P/D path's records (what the
router predicted P held, against P's ``usage.prompt_tokens_details.cached_tokens``); on D, over the
decode-only records only, because on the P/D path vLLM's D reports the tokens it pulled from P as
cached too, which the router never predicts as D's own.

Pure pandas over already-fetched frames (no I/O, no Streamlit).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from dashboard.summaries import counter_increases
from pdscope import semconv as sc

# the snapshot columns the hit rates read
SERIES_COLUMNS = (
    "ts",
    "instance",
    "pool",
    "role",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "external_prefix_cache_queries",
    "external_prefix_cache_hits",
)
LOCAL = "local"  # the instance's own prefix cache
EXTERNAL = "external"  # found through the KV connector (on D: pulled from P)
_KINDS = {
    LOCAL: ("prefix_cache_hits", "prefix_cache_queries"),
    EXTERNAL: ("external_prefix_cache_hits", "external_prefix_cache_queries"),
}
_COUNTERS = [c for pair in _KINDS.values() for c in pair]


def _bucketed_increases(series: pd.DataFrame, start: float, width_s: float) -> pd.DataFrame:
    """Per instance and bucket: each hit and query counter's increase (the first scrape has none)."""
    steps = counter_increases(series, [c for c in _COUNTERS if c in series])
    steps["b"] = np.floor((steps["ts"].astype(float) - start) / width_s).astype(int)
    for col in _COUNTERS:
        if col not in steps:
            steps[col] = np.nan
    return (
        steps[["instance", "role", "b", *_COUNTERS]]
        .groupby(["instance", "role", "b"], as_index=False)
        .sum(min_count=1)
    )


def hit_rates(series: pd.DataFrame, start: float, width_s: float) -> pd.DataFrame:
    """Per instance, kind (``local``, ``external``) and time bucket: hits / queries of that bucket.

    Columns: t (bucket start, Unix s), instance, role, kind, hit_rate, queries. Buckets without a
    query are left out (0/0 is no rate); ``external`` only where the instance counted any.
    """
    cols = ["t", "instance", "role", "kind", "hit_rate", "queries"]
    if series.empty:
        return pd.DataFrame(columns=cols)
    inc = _bucketed_increases(series, start, width_s)
    rows = []
    for kind, (hits, queries) in _KINDS.items():
        have = inc[inc[queries].fillna(0) > 0]
        if have.empty:
            continue
        part = have[["instance", "role"]].copy()
        part["t"] = start + have["b"].astype(float) * width_s
        part["kind"] = kind
        part["hit_rate"] = (have[hits].fillna(0) / have[queries]).clip(0.0, 1.0)
        part["queries"] = have[queries]
        rows.append(part)
    if not rows:
        return pd.DataFrame(columns=cols)
    return pd.concat(rows, ignore_index=True)[cols].sort_values(["t", "instance", "kind"], ignore_index=True)


def window_hit_rates(series: pd.DataFrame) -> pd.DataFrame:
    """Per instance over the whole window: local and external hit rate (None without queries)."""
    cols = ["instance", "role", "hit_rate", "external_hit_rate"]
    if series.empty:
        return pd.DataFrame(columns=cols)
    present = [c for c in _COUNTERS if c in series]
    roles = series.sort_values("ts", kind="stable").groupby("instance")["role"].last()
    totals = (
        counter_increases(series, present)
        .groupby("instance")[present]
        .sum()
        .reindex(index=roles.index, columns=_COUNTERS, fill_value=0.0)
    )
    rows = []
    for name, role in roles.items():
        row: dict[str, object] = {"instance": name, "role": role}
        for kind, (hits, queries) in _KINDS.items():
            h, q = float(totals.at[name, hits]), float(totals.at[name, queries])
            row["hit_rate" if kind == LOCAL else "external_hit_rate"] = h / q if q > 0 else None
        rows.append(row)
    return pd.DataFrame(rows, columns=cols)


def _sum(values: pd.Series) -> float:
    return float(values.astype(float).sum())


def predicted_vs_reported(sample: pd.DataFrame, step: int = 1) -> pd.DataFrame:
    """Per instance: the cached prompt tokens the router predicted it held, and what vLLM reported.

    P: over P/D-path records with both figures; D: over decode-only records with both (see the
    module's note). Columns: instance, role, requests, predicted, reported (sums, scaled by
    ``step``), reported_per_predicted (None when nothing was predicted).
    """
    cols = ["instance", "role", "requests", "predicted", "reported", "reported_per_predicted"]
    if sample.empty or "route_path" not in sample:
        return pd.DataFrame(columns=cols)
    sides = (
        ("prefill", "p_instance", sc.ROUTE_PD, "p_predicted_cached_tokens", "p_cached_tokens"),
        ("decode", "d_instance", sc.ROUTE_DECODE_ONLY, "d_predicted_cached_tokens", "d_cached_tokens"),
    )
    rows = []
    for role, inst, path, predicted, reported in sides:
        mine = sample[(sample["route_path"] == path) & sample[predicted].notna() & sample[reported].notna()]
        mine = mine[mine[inst].notna()]
        for name, part in mine.groupby(inst, sort=True):
            p, r = _sum(part[predicted]) * step, _sum(part[reported]) * step
            rows.append(
                {
                    "instance": name,
                    "role": role,
                    "requests": len(part) * step,
                    "predicted": p,
                    "reported": r,
                    "reported_per_predicted": r / p if p > 0 else None,
                }
            )
    return pd.DataFrame(rows, columns=cols)


def _spread(values: pd.Series) -> str:
    """ "prefill-0 80% · prefill-1 20%": who served them, most first (ties by name)."""
    counts = values.dropna().value_counts()
    if counts.empty:
        return "—"
    total = float(counts.sum())
    order = sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))
    return " · ".join(f"{name} {100.0 * n / total:.0f}%" for name, n in order)


def hot_prefixes(sample: pd.DataFrame, step: int = 1, top: int = 10) -> pd.DataFrame:
    """The prefixes most requests matched in the window, most first.

    Columns: prefix_key, requests (scaled by ``step``), share (of the window's routed requests),
    prefix_tokens (the median matched length), tokens (matched tokens in all, scaled), decode_only
    (share of its requests served without P), p_instances ("prefill-0 80% · prefill-1 20%").
    """
    cols = ["prefix_key", "requests", "share", "prefix_tokens", "tokens", "decode_only", "p_instances"]
    if sample.empty or "prefix_key" not in sample:
        return pd.DataFrame(columns=cols)
    routed = sample[sample["route_path"].notna()]
    keyed = routed[routed["prefix_key"].notna()]
    if keyed.empty:
        return pd.DataFrame(columns=cols)
    rows = []
    for key, part in keyed.groupby("prefix_key", sort=False):
        tokens = part["prefix_tokens"].astype(float)
        rows.append(
            {
                "prefix_key": key,
                "requests": len(part) * step,
                "share": len(part) / len(routed),
                "prefix_tokens": None if tokens.isna().all() else float(tokens.median()),
                "tokens": float(tokens.fillna(0).sum()) * step,
                "decode_only": float((part["route_path"] == sc.ROUTE_DECODE_ONLY).mean()),
                "p_instances": _spread(part["p_instance"]),
            }
        )
    out = pd.DataFrame(rows, columns=cols)
    return out.sort_values(["requests", "prefix_key"], ascending=[False, True], ignore_index=True).head(top)


def decode_only_share(sample: pd.DataFrame, start: float, width_s: float) -> pd.DataFrame:
    """Per time bucket: routed requests and the share of them served without P (``decode_only``).

    Columns: t (bucket start, Unix s), routed, decode_only (counts in the sample), share.
    """
    cols = ["t", "routed", "decode_only", "share"]
    if sample.empty or "route_path" not in sample:
        return pd.DataFrame(columns=cols)
    routed = sample[sample["route_path"].notna()]
    if routed.empty:
        return pd.DataFrame(columns=cols)
    b = np.floor((routed["proxy_in"].astype(float) - start) / width_s).astype(int)
    grouped = (
        pd.DataFrame({"b": b, "do": routed["route_path"] == sc.ROUTE_DECODE_ONLY})
        .groupby("b")["do"]
        .agg(["size", "sum"])
    )
    out = pd.DataFrame(
        {
            "t": start + grouped.index.astype(float) * width_s,
            "routed": grouped["size"].astype(int).to_numpy(),
            "decode_only": grouped["sum"].astype(int).to_numpy(),
        }
    )
    out["share"] = out["decode_only"] / out["routed"]
    return out[cols]


def headline(rates: pd.DataFrame, compared: pd.DataFrame, sample: pd.DataFrame) -> dict[str, float | None]:
    """The page's figures: the mean of the P instances' window hit rates and of the D instances'
    external ones (each instance counts once, however busy), P's reported per predicted cached
    tokens over all P instances, and the window's share of routed requests served without P."""

    def mean(values: pd.Series) -> float | None:
        v = values.dropna().astype(float)
        return float(v.mean()) if len(v) else None

    p_rates = rates[rates["role"] == "prefill"] if not rates.empty else rates
    d_rates = rates[rates["role"] == "decode"] if not rates.empty else rates
    p_cmp = compared[compared["role"] == "prefill"] if not compared.empty else compared
    predicted = float(p_cmp["predicted"].sum()) if not p_cmp.empty else 0.0
    routed = sample[sample["route_path"].notna()] if "route_path" in sample else sample.iloc[0:0]
    share = float((routed["route_path"] == sc.ROUTE_DECODE_ONLY).mean()) if len(routed) else None
    return {
        "p_hit_rate": mean(p_rates["hit_rate"]) if not p_rates.empty else None,
        "d_external_hit_rate": mean(d_rates["external_hit_rate"]) if not d_rates.empty else None,
        "p_reported_per_predicted": float(p_cmp["reported"].sum()) / predicted if predicted > 0 else None,
        "decode_only_share": share if share is None or math.isfinite(share) else None,
    }
