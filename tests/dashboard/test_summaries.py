from __future__ import annotations

import pandas as pd
import pytest

from dashboard.summaries import (
    attribute_frame,
    avoided_pairs,
    handoff_by,
    handoff_effects,
    instance_health,
    interval_means,
    interval_rates,
    nixl_per_instance,
    percentiles_ms,
    pool_totals,
    rate_per_instance,
    slo_figures,
    stranded_kv,
)


def _hist(counts: list[float], total_sum: float) -> dict[str, object]:
    return {"le": [0.01, 0.1, 1.0], "counts": counts, "sum": total_sum, "count": counts[-1]}


def test_interval_rates_handle_a_restart() -> None:
    series = pd.DataFrame(
        {
            "ts": [0.0, 5.0, 10.0, 15.0],
            "instance": ["d"] * 4,
            "role": ["decode"] * 4,
            "generation_tokens": [100.0, 150.0, 20.0, 70.0],
        }
    )
    rates = interval_rates(series, ("generation_tokens",))
    assert list(rates["generation_tokens"]) == [10.0, 4.0, 10.0]  # the drop counts 20 from zero


def test_a_failed_scrape_is_no_spike() -> None:
    """A failed scrape is stored without counters: it has no rate, and the next scrape's rate runs from
    the last value present, over the time since it (not its whole value over one interval)."""
    series = pd.DataFrame(
        {
            "ts": [0.0, 5.0, 10.0, 15.0],
            "instance": ["p"] * 4,
            "role": ["prefill"] * 4,
            "nixl_failed_transfers": [400.0, 401.0, None, 403.0],
            "nixl_xfer_time_sum": [40.0, 41.0, None, 43.0],
            "nixl_xfer_time_count": [400.0, 410.0, None, 430.0],
        }
    )
    rates = interval_rates(series, ("nixl_failed_transfers",))["nixl_failed_transfers"]
    assert rates.iloc[0] == pytest.approx(0.2)
    assert pd.isna(rates.iloc[1])
    assert rates.iloc[2] == pytest.approx(0.2)  # 2 over the 10 s since 401
    means = interval_means(series, "nixl_xfer_time_sum", "nixl_xfer_time_count")
    assert list(means["ts"]) == [5.0, 15.0]
    assert list(means["value"]) == [pytest.approx(0.1), pytest.approx(0.1)]


def test_two_scrapes_at_one_time_have_no_rate() -> None:
    series = pd.DataFrame(
        {
            "ts": [0.0, 5.0, 5.0, 10.0],
            "instance": ["d"] * 4,
            "role": ["decode"] * 4,
            "c": [0.0, 5.0, 6.0, 11.0],
        }
    )
    rates = interval_rates(series, ("c",))["c"]
    assert rates.iloc[0] == pytest.approx(1.0)
    assert pd.isna(rates.iloc[1])
    assert rates.iloc[2] == pytest.approx(1.0)


def test_interval_means_skip_idle_intervals() -> None:
    series = pd.DataFrame(
        {"ts": [0.0, 5.0, 10.0], "instance": ["d"] * 3, "s": [1.0, 1.5, 1.5], "c": [10.0, 20.0, 20.0]}
    )
    out = interval_means(series, "s", "c", 1000.0)
    assert list(out["value"]) == [pytest.approx(50.0)]


def test_nixl_per_instance_from_counters_and_histograms() -> None:
    series = pd.DataFrame(
        {
            "ts": [0.0, 10.0, 0.0, 10.0],
            "instance": ["d0", "d0", "p0", "p0"],
            "role": ["decode", "decode", "prefill", "prefill"],
            "nixl_xfer_time_count": [0.0, 100.0, 0.0, 0.0],
            "nixl_xfer_time_sum": [0.0, 2.0, 0.0, 0.0],
            "nixl_post_time_count": [0.0, 100.0, 0.0, 0.0],
            "nixl_post_time_sum": [0.0, 0.1, 0.0, 0.0],
            "nixl_bytes_sum": [0.0, 4e9, 0.0, 0.0],
            "nixl_descriptors_sum": [0.0, 5000.0, 0.0, 0.0],
            "nixl_failed_transfers": [1.0, 3.0, 0.0, 0.0],
            "nixl_kv_expired_reqs": [0.0, 0.0, 5.0, 7.0],
        }
    )
    edges = {
        "d0": (
            {"vllm:nixl_xfer_time_seconds": _hist([0, 0, 0, 0], 0)},
            {"vllm:nixl_xfer_time_seconds": _hist([10, 90, 100, 100], 2.0)},
        )
    }
    out = nixl_per_instance(series, edges).set_index("instance")
    d0 = out.loc["d0"]
    assert d0["transfers"] == 100 and d0["xfer_mean_ms"] == pytest.approx(20.0)
    assert d0["MB_per_s"] == pytest.approx(2000.0)  # 4 GB over 2 s of transfer time
    assert d0["MB_per_transfer"] == pytest.approx(40.0) and d0["descriptors_per_transfer"] == 50
    assert d0["failed_transfers"] == 2
    assert d0["xfer_p50_ms"] == pytest.approx(10 + 90 * (50 - 10) / 80)
    assert out.loc["p0", "expired_leases"] == 2


def test_instance_health_and_pool_totals() -> None:
    latest = pd.DataFrame(
        [
            {
                "instance": "d0",
                "pool": "dec",
                "role": "decode",
                "up": True,
                "kv_cache_usage": 0.5,
                "num_running": 4.0,
                "num_waiting": 1.0,
                "ts": 10.0,
            },
            {
                "instance": "d1",
                "pool": "dec",
                "role": "decode",
                "up": False,
                "kv_cache_usage": None,
                "num_running": 0.0,
                "num_waiting": 0.0,
                "ts": 10.0,
            },
        ]
    )
    series = pd.DataFrame(
        {
            "ts": [0.0, 10.0],
            "instance": ["d0", "d0"],
            "nixl_xfer_time_sum": [0.0, 1.0],
            "nixl_xfer_time_count": [0.0, 50.0],
            "nixl_failed_transfers": [0.0, 0.0],
            "nixl_kv_expired_reqs": [0.0, 0.0],
        }
    )
    edges = {
        "d0": (
            {"vllm:time_to_first_token_seconds": _hist([0, 0, 0, 0], 0)},
            {"vllm:time_to_first_token_seconds": _hist([0, 50, 100, 100], 5.0)},
        )
    }
    weights = pd.DataFrame({"subject": ["d0"], "weight": [0.75]})
    health = instance_health(series, latest, edges, weights).set_index("instance")
    assert health.loc["d0", "weight"] == 0.75 and pd.isna(health.loc["d1", "weight"])
    assert health.loc["d0", "kv_cache_usage_pct"] == 50.0
    assert health.loc["d0", "ttft_p50_ms"] == pytest.approx(100.0)
    assert health.loc["d0", "nixl_xfer_mean_ms"] == pytest.approx(20.0)
    totals = pool_totals(health.reset_index())
    assert totals.iloc[0][["up", "instances", "running"]].tolist() == [1, 2, 4.0]


def test_slo_figures_and_handoff_by_on_empty_input() -> None:
    assert slo_figures(pd.DataFrame(), pd.DataFrame(), 60.0) is None
    assert handoff_by(pd.DataFrame()).empty
    assert percentiles_ms(pd.Series([], dtype=float)) == {"p50": None, "p90": None, "p99": None}
    assert percentiles_ms(pd.Series([0.1, 0.2, 0.3]))["p50"] == pytest.approx(200.0)


def test_attribute_frame_takes_attributes_and_computed_columns_in_order() -> None:
    class Row:
        def __init__(self, name: str, n: int) -> None:
            self.name, self.n = name, n

    got = attribute_frame([Row("a", 1), Row("b", 2)], ("n", "name", "twice"), {"twice": lambda r: 2 * r.n})
    assert list(got.columns) == ["n", "name", "twice"]
    assert got.to_dict("records") == [{"n": 1, "name": "a", "twice": 2}, {"n": 2, "name": "b", "twice": 4}]
    assert list(attribute_frame([], ("n", "name")).columns) == ["n", "name"]  # empty: still the columns


def test_handoff_effects_put_a_p_slow_toward_every_d_on_its_row() -> None:
    """The KV transfer page factors the pair matrix as the controller does: the P is blamed, no D."""
    rows = [
        {"p_instance": p, "d_instance": d, "requests": 20, "p50_ms": 500.0 if p == "prefill-1" else 50.0}
        for p in ("prefill-0", "prefill-1")
        for d in ("decode-0", "decode-1", "decode-2")
    ]
    effects, fit = handoff_effects(pd.DataFrame(rows))
    by = effects.set_index("instance")
    assert by.loc["prefill-1", "effect_x"] == pytest.approx(10.0)
    assert bool(by.loc["prefill-1", "blamed"]) and not by["blamed"].drop("prefill-1").any()
    assert list(by["side"]) == ["P", "P", "D", "D", "D"]
    assert fit.typical == pytest.approx(0.05)
    assert [b.name for b in fit.blames] == ["prefill-1"]
    empty, none = handoff_effects(handoff_by(pd.DataFrame(), "pair"))
    assert empty.empty and none.blames == ()


def test_stranded_kv_reads_an_idle_p_holding_kv_the_ds_pulls_and_the_unserved_handoffs() -> None:
    def snap(ts: float, inst: str, role: str, usage: float, running: float = 0.0, **kw: object) -> dict:
        row = {"ts": ts, "instance": inst, "role": role, "up": True, "kv_cache_usage": usage}
        return row | {"num_running": running, "num_waiting": 0.0} | kw

    d = {"kv_fetch_waiting_to_start": 0.0, "kv_fetch_in_progress": 0.0}
    series = pd.DataFrame(
        [
            snap(0.0, "p0", "prefill", 0.3, running=2.0),
            snap(5.0, "p0", "prefill", 0.1),  # idle and holding from here
            snap(10.0, "p0", "prefill", 0.1),
            snap(10.0, "p1", "prefill", 0.2, running=1.0),  # busy: its KV is its own
            snap(10.0, "d0", "decode", 0.5, **d),
            snap(9.0, "d1", "decode", 0.5, kv_fetch_waiting_to_start=1.0, kv_fetch_in_progress=0.0),
            snap(11.0, "d1", "decode", 0.5, **d),  # the newest scrape counts
        ]
    )
    sample = pd.DataFrame(
        {"p_instance": ["p0", "p0", "p1"], "p_done": [1.0, 2.0, 3.0], "first_token": [None, 2.5, None]}
    )
    per_p, pending = stranded_kv(series, sample, step=2)
    rows = per_p.set_index("instance")
    assert pending == 0.0
    assert (
        rows.loc["p0", "held_while_idle_pct"] == pytest.approx(10.0) and rows.loc["p0", "held_for_s"] == 6.0
    )
    assert pd.isna(rows.loc["p1", "held_while_idle_pct"])
    assert (rows.loc["p0", "unserved_handoffs"], rows.loc["p1", "unserved_handoffs"]) == (2, 2)  # x the step
    missing = series.assign(kv_fetch_in_progress=None)
    assert stranded_kv(missing, sample, 1)[1] is None  # a D whose gauges are missing: unknown


def test_avoided_pairs_reads_the_routing_tables_pairs_and_skips_malformed_ones() -> None:
    table = {
        "avoid_pairs": [
            {
                "prefill": "p0",
                "decode": "d1",
                "reason": "IncompatiblePair",
                "since": 90.0,
                "text": "block_size",
            },
            {"prefill": "p1", "decode": "d0", "reason": "StalePeerAfterRestart", "since": "soon"},
            {"prefill": 3, "decode": "d0"},
            "junk",
        ]
    }
    rows = avoided_pairs(table, now=100.0)
    assert rows[["prefill", "decode", "reason"]].values.tolist() == [
        ["p0", "d1", "IncompatiblePair"],
        ["p1", "d0", "StalePeerAfterRestart"],
    ]
    assert rows["for_s"].iloc[0] == 10.0 and pd.isna(rows["for_s"].iloc[1])
    assert avoided_pairs(None, 0.0).empty and avoided_pairs({"avoid_pairs": None}, 0.0).empty


def test_rate_per_instance_of_one_role() -> None:
    rates = pd.DataFrame(
        {
            "instance": ["p0", "p0", "p1", "d0"],
            "role": ["prefill", "prefill", "prefill", "decode"],
            "prompt_tokens": [100.0, 300.0, 50.0, 9.0],
        }
    )
    per = rate_per_instance(rates, "prefill", "prompt_tokens").set_index("instance")
    assert list(per.index) == ["p0", "p1"]
    assert per.loc["p0", "mean"] == 200.0 and per.loc["p0", "peak"] == 300.0
    assert per.loc["p1", "p95"] == 50.0
    assert rate_per_instance(rates, "router", "prompt_tokens").empty
