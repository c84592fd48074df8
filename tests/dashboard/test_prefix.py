"""The Prefix cache page's frames (dashboard.prefix) from small hand-made snapshot and record frames."""

from __future__ import annotations

from typing import Any

import pandas as pd
import pytest

from dashboard import prefix
from dashboard.derive import D_ALONE, cache_summary, waterfall


def _snap(instance: str, role: str, ts: list[float], **counters: list[float | None]) -> pd.DataFrame:
    return pd.DataFrame({"ts": ts, "instance": instance, "role": role, "pool": role, **counters})


def test_hit_rates_per_bucket_take_a_restart_and_leave_out_buckets_without_queries() -> None:
    p = _snap(
        "p0",
        "prefill",
        [0.0, 30.0, 60.0, 90.0, 120.0, 150.0],
        # 100 queries per scrape; 80 hits, then a restart (counters from 0) with an empty cache
        prefix_cache_queries=[0.0, 100.0, 200.0, 100.0, 200.0, 200.0],
        prefix_cache_hits=[0.0, 80.0, 160.0, 0.0, 10.0, 10.0],
    )
    rates = prefix.hit_rates(p, start=0.0, width_s=60.0)
    local = rates[rates["kind"] == prefix.LOCAL]
    # bucket 0: scrape at 30 (80/100); bucket 1: 60 and 90 (80 + 0 after the restart / 200);
    # bucket 2: 120 (10/100) and 150 (nothing queried: 10/100 still)
    assert list(local["t"]) == [0.0, 60.0, 120.0]
    assert list(local["hit_rate"]) == pytest.approx([0.8, 0.4, 0.1])
    assert list(local["queries"]) == [100.0, 200.0, 100.0]
    assert rates[rates["kind"] == prefix.EXTERNAL].empty  # P counts no external lookups


def test_external_hit_rate_on_d_and_window_rates() -> None:
    d = _snap(
        "d0",
        "decode",
        [0.0, 10.0, 20.0],
        prefix_cache_queries=[0.0, 100.0, 300.0],
        prefix_cache_hits=[0.0, 10.0, 30.0],
        external_prefix_cache_queries=[0.0, 90.0, 270.0],
        external_prefix_cache_hits=[0.0, 85.0, 260.0],
    )
    idle = _snap("p1", "prefill", [0.0, 10.0], prefix_cache_queries=[5.0, 5.0], prefix_cache_hits=[1.0, 1.0])
    series = pd.concat([d, idle], ignore_index=True)
    rates = prefix.hit_rates(series, 0.0, 10.0)
    ext = rates[rates["kind"] == prefix.EXTERNAL]
    assert list(ext["hit_rate"]) == pytest.approx([85 / 90, 175 / 180])
    assert set(rates["instance"]) == {"d0"}  # the idle P queried nothing: no rate, not 0
    window = prefix.window_hit_rates(series).set_index("instance")
    assert window.loc["d0", "hit_rate"] == pytest.approx(0.1)
    assert window.loc["d0", "external_hit_rate"] == pytest.approx(260 / 270)
    assert pd.isna(window.loc["p1", "hit_rate"]) and pd.isna(window.loc["p1", "external_hit_rate"])
    assert prefix.hit_rates(series.iloc[0:0], 0.0, 10.0).empty


COLUMNS = (
    "proxy_in",
    "route_path",
    "p_instance",
    "d_instance",
    "p_predicted_cached_tokens",
    "p_cached_tokens",
    "d_predicted_cached_tokens",
    "d_cached_tokens",
    "prefix_key",
    "prefix_tokens",
)


def _records(rows: list[tuple[Any, ...]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=list(COLUMNS))


SAMPLE = _records(
    [
        # t, path, P, D, P predicted, P reported, D predicted, D reported, prefix, its tokens
        (0.0, "pd", "p0", "d0", 512, 512, 0, 896, "aa", 512),
        (1.0, "pd", "p0", "d1", 512, 256, 512, 896, "aa", 512),  # P had evicted half
        (2.0, "pd", "p1", "d0", 0, 0, 0, 400, None, None),  # nothing shared
        (3.0, "decode_only", None, "d0", None, None, 512, 496, "aa", 512),
        (61.0, "pd", "p1", "d1", 256, 256, 0, 700, "bb", 256),
        (62.0, "decode_only", None, "d1", None, None, 256, 256, "bb", 256),
        (63.0, None, None, None, None, None, None, None, None, None),  # rejected: never routed
        (64.0, "pd", "p1", "d0", 256, None, 0, None, "bb", 256),  # failed: no report
    ]
)


def test_predicted_vs_reported_compares_like_for_like() -> None:
    out = prefix.predicted_vs_reported(SAMPLE, step=2).set_index("instance")
    # P: the P/D path's records with both figures; D: its decode-only records only
    assert out.loc["p0", "requests"] == 4 and out.loc["p0", "predicted"] == 2048.0
    assert out.loc["p0", "reported"] == 1536.0 and out.loc["p0", "reported_per_predicted"] == 0.75
    assert out.loc["p1", "requests"] == 4 and out.loc["p1", "reported_per_predicted"] == 1.0
    assert out.loc["d0", "requests"] == 2 and out.loc["d0", "reported"] == 992.0
    assert out.loc["d1", "predicted"] == 512.0 and out.loc["d1", "role"] == "decode"
    nothing = _records([(0.0, "pd", "p0", "d0", 0, 0, 0, 10, None, None)])
    assert prefix.predicted_vs_reported(nothing).iloc[0]["reported_per_predicted"] is None
    assert prefix.predicted_vs_reported(SAMPLE.iloc[0:0]).empty


def test_hot_prefixes_count_share_and_who_served_them() -> None:
    hot = prefix.hot_prefixes(SAMPLE, step=3)
    assert list(hot["prefix_key"]) == ["aa", "bb"]  # 3 requests each; ties by key
    aa = hot.iloc[0]
    assert aa["requests"] == 9 and aa["share"] == pytest.approx(3 / 7)  # of the 7 routed
    assert aa["prefix_tokens"] == 512 and aa["tokens"] == 3 * 3 * 512
    assert aa["decode_only"] == pytest.approx(1 / 3)
    assert aa["p_instances"] == "p0 100%"
    assert hot.iloc[1]["p_instances"] == "p1 100%"
    assert list(prefix.hot_prefixes(SAMPLE, top=1)["prefix_key"]) == ["aa"]
    assert prefix.hot_prefixes(SAMPLE[SAMPLE["prefix_key"].isna()]).empty


def test_decode_only_share_per_bucket() -> None:
    share = prefix.decode_only_share(SAMPLE, start=0.0, width_s=60.0)
    assert list(share["t"]) == [0.0, 60.0]
    assert list(share["routed"]) == [4, 3] and list(share["decode_only"]) == [1, 1]
    assert list(share["share"]) == pytest.approx([0.25, 1 / 3])


def test_headline_figures() -> None:
    rates = pd.DataFrame(
        {
            "instance": ["p0", "p1", "d0"],
            "role": ["prefill", "prefill", "decode"],
            "hit_rate": [0.2, 0.4, 0.1],
            "external_hit_rate": [None, None, 0.9],
        }
    )
    figures = prefix.headline(rates, prefix.predicted_vs_reported(SAMPLE), SAMPLE)
    assert figures["p_hit_rate"] == pytest.approx(0.3)
    assert figures["d_external_hit_rate"] == pytest.approx(0.9)
    assert figures["p_reported_per_predicted"] == pytest.approx(1024 / 1280)
    assert figures["decode_only_share"] == pytest.approx(2 / 7)
    empty = prefix.headline(rates.iloc[0:0], prefix.predicted_vs_reported(SAMPLE.iloc[0:0]), SAMPLE.iloc[0:0])
    assert set(empty.values()) == {None}


def test_the_waterfall_of_a_decode_only_request_has_no_p_and_says_what_was_cached() -> None:
    rec = {
        "proxy_in": 10.0,
        "route_path": "decode_only",
        "p_sent": None,
        "p_done": None,
        "d_sent": 10.002,
        "first_token": 10.050,
        "done": 10.400,
        "prompt_tokens": 600,
        "d_predicted_cached_tokens": 512,
        "d_cached_tokens": 496,
    }
    stages = {s.name: s for s in waterfall(rec)}
    assert list(stages) == ["proxy", D_ALONE, "first token", "decode"]
    assert stages["proxy"].end_ms == pytest.approx(2.0)
    assert stages[D_ALONE].duration_ms == pytest.approx(48.0)
    assert "496 of 600 prompt tokens cached (predicted 512)" in stages[D_ALONE].note
    line = cache_summary({**rec, "prefix_key": "00ff", "prefix_tokens": 512})
    assert (
        line == "route **decode only** (no P) · D cached **496** (predicted 512) · prefix `00ff` (512 tokens)"
    )


def test_the_pd_waterfall_notes_cached_tokens_on_p_and_d() -> None:
    rec = {
        "proxy_in": 0.0,
        "route_path": "pd",
        "p_sent": 0.001,
        "p_done": 0.101,
        "p_queue_s": 0.02,
        "d_sent": 0.102,
        "first_token": 0.2,
        "done": 0.5,
        "prompt_tokens": 900,
        "p_predicted_cached_tokens": 512,
        "p_cached_tokens": 256,
        "d_cached_tokens": 896,
    }
    stages = {s.name: s for s in waterfall(rec)}
    assert "256 of 900 prompt tokens cached (predicted 512)" in stages["P prefill"].note
    assert "896 of 900 prompt tokens cached (predicted —)" in stages["handoff (D queue incl. KV pull)"].note
    assert (
        cache_summary(rec)
        == "route **pd** · P cached **256** (predicted 512) · D cached **896** (predicted —)"
    )
    # a record without KV-aware routing: no line, notes as before
    plain = {k: v for k, v in rec.items() if "cached" not in k and k != "route_path"}
    assert cache_summary(plain) is None
    assert all("cached" not in s.note for s in waterfall(plain))
