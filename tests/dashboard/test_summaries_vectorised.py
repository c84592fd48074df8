"""The frame-wide counter rates, means and increases (and the Prefix cache page's hit rates made of them)
against the plain per-instance rules they vectorise (written out here as loops), on random frames:
instances interleaved, rows out of time order, gaps and counter resets, index labels repeated, a row with
no instance. Scrapes of one instance at the same time are taken in row order (the loops' stable sort; the
per-instance code this replaced left their order to an unstable sort)."""

from __future__ import annotations

import math
import random

import numpy as np
import pandas as pd
import pytest

from dashboard import prefix
from dashboard.summaries import counter_totals, interval_means, interval_rates
from pdscope.stats import counter_increase


def _frame(rng: random.Random) -> pd.DataFrame:
    rows = []
    for name in rng.sample(["p-2", "d-10", "d-1", "p-1", "d-3"], rng.randint(1, 5)):
        value, total = 0.0, 0.0
        for k in range(rng.randint(1, 12)):
            value = rng.uniform(0, 5) if rng.random() < 0.1 else value + rng.choice([0.0, rng.uniform(0, 50)])
            total += rng.uniform(0, 3)
            rows.append(
                {
                    "ts": 5.0 * k,
                    "instance": name,
                    "role": "prefill" if name.startswith("p") else "decode",
                    "c": None if rng.random() < 0.1 else value,
                    "s": total,
                    "n": math.nan if rng.random() < 0.1 else float(k // 2),
                    "prefix_cache_queries": 10.0 * k,
                    "prefix_cache_hits": None if rng.random() < 0.1 else value,
                }
            )
    rows.append({**rows[0], "instance": None})  # no instance: left out, as a group-by leaves it
    rng.shuffle(rows)
    frame = pd.DataFrame(rows)
    frame.index = np.arange(len(frame)) % 3  # labels repeat, as in frames concatenated
    return frame


def _steps_by_loop(mine: pd.DataFrame, col: str, per_second: bool = False) -> list[float]:
    """One instance's rows by time: each value's increase since the last present one (a fall: the
    value), over the seconds between them with ``per_second``; NaN for a missing value and the first."""
    out, prev, prev_ts = [], None, None
    for ts, raw in zip(mine["ts"], mine[col], strict=True):
        v = None if raw is None or not math.isfinite(float(raw)) else float(raw)
        if v is None or prev is None or prev_ts is None:
            out.append(math.nan)
        else:
            step = v - prev if v >= prev else v
            out.append(step / (float(ts) - prev_ts) if per_second else step)
        if v is not None:
            prev, prev_ts = v, float(ts)
    return out


def _rates_by_loop(series: pd.DataFrame, counters: tuple[str, ...]) -> pd.DataFrame:
    parts = []
    for _, mine in series.groupby("instance", sort=False):
        mine = mine.sort_values("ts", kind="stable")
        out = mine[["ts", "instance", "role"]].copy()
        for col in counters:
            out[col] = _steps_by_loop(mine, col, per_second=True)
        parts.append(out.iloc[1:])
    return pd.concat(parts, ignore_index=True)


def _means_by_loop(series: pd.DataFrame, sum_col: str, count_col: str) -> pd.DataFrame:
    parts = []
    both = series[series[sum_col].notna() & series[count_col].notna()]
    for _, mine in both.groupby("instance", sort=False):
        mine = mine.sort_values("ts", kind="stable")
        ds, dc = _steps_by_loop(mine, sum_col), _steps_by_loop(mine, count_col)
        value = [s / c if c > 0 else math.nan for s, c in zip(ds, dc, strict=True)]
        parts.append(pd.DataFrame({"ts": mine["ts"], "instance": mine["instance"], "value": value}).dropna())
    return pd.concat(parts, ignore_index=True)


@pytest.mark.parametrize("seed", range(40))
def test_rates_and_means_equal_the_per_instance_rules(seed: int) -> None:
    series = _frame(random.Random(seed))
    pd.testing.assert_frame_equal(interval_rates(series, ("c", "s")), _rates_by_loop(series, ("c", "s")))
    pd.testing.assert_frame_equal(interval_means(series, "s", "n"), _means_by_loop(series, "s", "n"))


@pytest.mark.parametrize("seed", range(40))
def test_totals_are_the_counter_rule(seed: int) -> None:
    series = _frame(random.Random(seed))
    totals = counter_totals(series, ("c", "n", "absent"))
    names = series["instance"].dropna().unique()
    assert sorted(totals.index) == sorted(names)
    for name in names:
        mine = series[series["instance"] == name].sort_values("ts", kind="stable")
        for col in ("c", "n"):
            want = counter_increase([None if pd.isna(v) else float(v) for v in mine[col]])
            got = totals.at[name, col]
            assert (want is None and np.isnan(got)) or got == pytest.approx(want, rel=1e-12)
        assert np.isnan(totals.at[name, "absent"])


def _increases_by_loop(mine: pd.DataFrame, column: str) -> pd.Series:
    return pd.Series(_steps_by_loop(mine, column), index=mine.index)


def _window_hit_rates_by_loop(series: pd.DataFrame) -> dict[str, tuple[object, object]]:
    out = {}
    for name, mine in series.groupby("instance", sort=True):
        mine = mine.sort_values("ts", kind="stable")
        h = float(_increases_by_loop(mine, "prefix_cache_hits").iloc[1:].sum())
        q = float(_increases_by_loop(mine, "prefix_cache_queries").iloc[1:].sum())
        out[name] = (mine["role"].iloc[-1], h / q if q > 0 else None)
    return out


def _bucketed_by_loop(series: pd.DataFrame, start: float, width_s: float) -> pd.DataFrame:
    parts = []
    for _, mine in series.groupby("instance", sort=False):
        mine = mine.sort_values("ts", kind="stable")
        out = mine[["instance", "role"]].copy()
        out["b"] = np.floor((mine["ts"].astype(float) - start) / width_s).astype(int)
        for col in ("prefix_cache_hits", "prefix_cache_queries"):
            out[col] = _increases_by_loop(mine, col)
        parts.append(out.iloc[1:])
    return (
        pd.concat(parts, ignore_index=True)
        .groupby(["instance", "role", "b"], as_index=False)
        .sum(min_count=1)
    )


@pytest.mark.parametrize("seed", range(40))
def test_prefix_hit_rates_equal_the_per_instance_rules(seed: int) -> None:
    series = _frame(random.Random(seed))
    got = prefix.window_hit_rates(series)
    want = _window_hit_rates_by_loop(series)
    assert list(got["instance"]) == sorted(want)
    for row in got.itertuples(index=False):
        role, rate = want[row.instance]
        assert row.role == role
        assert pd.isna(row.external_hit_rate)
        assert pd.isna(row.hit_rate) if rate is None else row.hit_rate == pytest.approx(rate, rel=1e-12)
    bucketed = prefix._bucketed_increases(series, 2.0, 15.0)
    loop = _bucketed_by_loop(series, 2.0, 15.0)
    pd.testing.assert_frame_equal(bucketed[loop.columns], loop, check_exact=False, rtol=1e-12)
    assert bucketed["external_prefix_cache_queries"].isna().all()


def test_totals_of_no_scrapes_are_empty() -> None:
    assert counter_totals(pd.DataFrame(), ("c",)).empty
    assert counter_totals(pd.DataFrame(columns=["ts", "instance", "c"]), ("c",)).empty
