"""analysis.rates: the P line, the handoff medians, from synthetic records of a known fleet."""

from __future__ import annotations

import random

import pytest

from analysis.rates import RateConfig, RateFacts, fit_prefill, fit_rates, prefill_tokens

BASE, SLOPE = 0.03, 0.0004  # the P's line: 30 ms plus 0.4 ms a token


def _rec(
    t: float,
    x: int,
    *,
    p: str = "p0",
    d: str = "d0",
    y: float | None = None,
    handoff: float = 0.05,
    status: str = "ok",
    retries: int = 0,
    ahead: int | None = 0,
) -> RateFacts:
    y = BASE + SLOPE * x if y is None else y
    own = x - (ahead or 0)
    return RateFacts(p, d, status, t, t + y, t + y + handoff, retries, own + 100, 100, ahead, own)


def _line_records(n: int, rng: random.Random, noise: float = 0.02, **kw: object) -> list[RateFacts]:
    out = []
    for i in range(n):
        x = rng.randint(100, 4000)
        y = (BASE + SLOPE * x) * (1 + rng.uniform(-noise, noise))
        out.append(_rec(float(i), x, y=y, ahead=x // 3, **kw))  # type: ignore[arg-type]
    return out


def _row(rates: object, name: str) -> object:
    return next(r for r in rates.instances if r.name == name)  # type: ignore[attr-defined]


def test_recovers_the_line_within_a_few_percent() -> None:
    rates = fit_rates(_line_records(200, random.Random(1)), now=500.0, window_s=60.0)
    p0 = _row(rates, "p0")
    assert p0.prefill_s_per_token == pytest.approx(SLOPE, rel=0.03)  # type: ignore[attr-defined]
    assert p0.prefill_base_s == pytest.approx(BASE, rel=0.15)  # type: ignore[attr-defined]
    assert p0.error is not None and p0.error < 0.03  # type: ignore[attr-defined]
    assert rates.fitted_at == 500.0 and rates.window_s == 60.0


def test_outliers_do_not_move_the_line() -> None:
    rng = random.Random(2)
    recs = _line_records(200, rng)
    # one in ten stalled: ten times as long as the line says
    recs += [_rec(1000.0 + i, 2000, y=10 * (BASE + SLOPE * 2000)) for i in range(20)]
    p0 = _row(fit_rates(recs, now=2000.0, window_s=60.0), "p0")
    assert p0.prefill_s_per_token == pytest.approx(SLOPE, rel=0.05)  # type: ignore[attr-defined]
    assert p0.prefill_base_s == pytest.approx(BASE, abs=0.01)  # type: ignore[attr-defined]


def test_too_few_records_give_the_ratio_with_base_zero_and_no_error() -> None:
    recs = [_rec(float(i), 1000) for i in range(5)]
    p0 = _row(fit_rates(recs, now=10.0, window_s=60.0), "p0")
    assert p0.prefill_base_s == 0.0  # type: ignore[attr-defined]
    assert p0.prefill_s_per_token == pytest.approx((BASE + SLOPE * 1000) / 1000)  # type: ignore[attr-defined]
    assert p0.error is None and p0.samples == 5  # type: ignore[attr-defined]


def test_no_spread_in_tokens_gives_the_ratio() -> None:
    recs = [_rec(float(i), 1000) for i in range(50)]
    fit = fit_prefill([(1000.0, BASE + SLOPE * 1000)] * 50)
    assert fit is not None and fit.base_s == 0.0 and fit.error == pytest.approx(0.0, abs=1e-9)
    p0 = _row(fit_rates(recs, now=10.0, window_s=60.0), "p0")
    assert p0.prefill_s_per_token == pytest.approx(BASE / 1000 + SLOPE)  # type: ignore[attr-defined]


def test_no_tokens_at_all_gives_the_base_alone() -> None:
    fit = fit_prefill([(0.0, 0.02), (0.0, 0.04), (0.0, 0.03)])
    assert fit is not None and fit.base_s == pytest.approx(0.03) and fit.s_per_token is None


def test_handoffs_per_d_and_per_pair_with_enough_samples() -> None:
    recs = [_rec(float(i), 1000, p="p0", d="d0", handoff=0.1) for i in range(6)]
    recs += [_rec(float(i), 1000, p="p1", d="d0", handoff=0.3) for i in range(3)]  # too few for a pair
    recs += [_rec(float(i), 1000, p="p1", d="d1", handoff=0.02) for i in range(5)]
    rates = fit_rates(recs, now=10.0, window_s=60.0)
    assert _row(rates, "d0").handoff_s == pytest.approx(0.1)  # type: ignore[attr-defined]
    assert _row(rates, "d1").handoff_s == pytest.approx(0.02)  # type: ignore[attr-defined]
    pairs = {(r.prefill, r.decode): (r.handoff_s, r.samples) for r in rates.pairs}
    assert set(pairs) == {("p0", "d0"), ("p1", "d1")}
    assert pairs[("p0", "d0")] == (pytest.approx(0.1), 6)


def test_failed_and_retried_records_are_left_out() -> None:
    good = [_rec(float(i), 1000, handoff=0.05) for i in range(12)]
    bad = [_rec(100.0 + i, 1000, y=5.0, handoff=2.0, status="error") for i in range(12)]
    bad += [_rec(200.0 + i, 1000, y=5.0, handoff=2.0, retries=1) for i in range(12)]
    rates = fit_rates(good + bad, now=300.0, window_s=300.0)
    assert _row(rates, "p0").samples == 12  # type: ignore[attr-defined]
    assert _row(rates, "d0").handoff_s == pytest.approx(0.05)  # type: ignore[attr-defined]


def test_missing_and_malformed_fields_are_skipped() -> None:
    recs = [
        RateFacts("p0", "d0", "ok", None, 1.0, 1.1, 0, 100, 0, None, None),  # no p_sent: handoff only
        RateFacts("p0", None, "ok", 0.0, 0.5, None, 0, None, None, None, None),  # no tokens: nothing
        RateFacts(None, "d0", "ok", 0.0, 0.5, 0.6, 0, 100, 0, None, None),  # no P: nothing
        RateFacts("p0", "d0", "ok", "x", float("nan"), 0.6, 0, 100, 0, None, None),  # junk times
        RateFacts("p" * 300, "d0", "ok", 0.0, 0.5, 0.6, 0, 100, 0, None, None),  # name out of bounds
        RateFacts("p0", "d0", "ok", 2.0, 1.0, None, 0, 100, 0, None, None),  # p_done before p_sent
    ]
    rates = fit_rates(recs, now=10.0, window_s=60.0)
    assert [r.name for r in rates.instances] == ["d0"]  # p0: no usable P time
    assert _row(rates, "d0").handoff_s == pytest.approx(0.1)  # type: ignore[attr-defined]
    assert fit_rates([], now=1.0, window_s=1.0).instances == []


def test_prefill_tokens_prefers_the_proxy_count() -> None:
    assert prefill_tokens(_rec(0.0, 900, ahead=300)) == 900.0  # ahead + own
    legacy = RateFacts("p0", "d0", "ok", 0.0, 1.0, 1.1, 0, 1000, 250, None, None)
    assert prefill_tokens(legacy) == 750.0  # the uncached prompt, nothing ahead
    assert prefill_tokens(legacy._replace(predict_tokens=True)) == 750.0  # a bool is no count


def test_the_newest_records_bound_the_work() -> None:
    old = [_rec(float(i), 1000, y=1.0) for i in range(100)]  # a slow past
    new = _line_records(50, random.Random(3))
    for r in new:
        assert isinstance(r.p_sent, float)
    new = [
        r._replace(p_sent=r.p_sent + 1000, p_done=r.p_done + 1000, first_token=r.first_token + 1000)
        for r in new
    ]  # type: ignore[operator]
    p0 = _row(fit_rates(old + new, now=2000.0, window_s=2000.0, cfg=RateConfig(max_per_instance=50)), "p0")
    assert p0.samples == 50  # type: ignore[attr-defined]
    assert p0.prefill_s_per_token == pytest.approx(SLOPE, rel=0.05)  # type: ignore[attr-defined]
