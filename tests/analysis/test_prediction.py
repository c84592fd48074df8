"""The TTFT predictor, measured: error quantiles per fleet, pool and instance, and which misses were
mispredicted (predicted in time, served late) or predicted late."""

from __future__ import annotations

import pytest

from analysis.prediction import ErrorFigures, PredictionFacts, measure, mispredicted_misses, ratio


def fact(
    ttft: object, pred: object, *, target: object = 1.0, pool: object = "prefill", inst: object = "p0"
) -> PredictionFacts:
    return PredictionFacts(pool, inst, ttft, pred, target)


def test_the_error_is_the_distance_of_observed_over_predicted_from_one() -> None:
    rows = [fact(0.5 * (1 + e), 0.5) for e in (0.0, 0.1, -0.2, 0.3, 0.4)]
    f = measure(rows).fleet
    assert (f.predicted, f.measured) == (5, 5)
    assert f.error_p50 == pytest.approx(0.2)  # |errors| 0, .1, .2, .3, .4
    assert f.error_p90 == pytest.approx(0.36)
    assert f.misses == 0 and f.mispredicted_share is None


def test_records_without_an_observed_ttft_count_as_predicted_only() -> None:
    rows = [
        fact(None, 0.8),  # rejected predicted_late, or failed: no TTFT
        fact(0.4, 0.0),  # a prediction of zero has no ratio
        fact(float("nan"), 0.5),
        fact(0.5, True),  # not a number: no prediction at all
        fact(0.6, None),  # no prediction
        fact(0.5, 0.5),
    ]
    f = measure(rows).fleet
    assert (f.predicted, f.measured, f.error_p50) == (4, 1, 0.0)
    assert measure([]).fleet == ErrorFigures()


def test_misses_are_split_into_mispredicted_and_predicted_late() -> None:
    rows = [
        fact(1.5, 0.7, target=1.0),  # predicted in time, served late: mispredicted
        fact(1.2, 0.9, target=1.0),  # mispredicted
        fact(1.1, 1.0, target=1.0),  # a prediction at the target is in time: mispredicted
        fact(2.0, 1.6, target=1.0),  # predicted late (admitted anyway)
        fact(0.8, 0.9, target=1.0),  # met
        fact(3.0, 2.0, target=None),  # no target: not judged
    ]
    f = measure(rows).fleet
    assert (f.misses, f.mispredicted, f.predicted_late) == (4, 3, 1)
    assert f.mispredicted_share == 0.75
    text = mispredicted_misses(f)
    assert text is not None and "3 of 4 TTFT misses (75%) were mispredicted" in text
    assert "of 4 TTFT misses 3 were predicted in time and 1 predicted late" in f.summary()


def test_mostly_predicted_late_misses_are_not_blamed_on_the_predictor() -> None:
    rows = [fact(1.5, 1.4), fact(1.5, 1.3), fact(1.5, 0.9)]
    f = measure(rows).fleet
    assert (f.mispredicted, f.predicted_late) == (1, 2)
    assert mispredicted_misses(f) is None
    assert mispredicted_misses(measure([fact(1.5, 0.9), fact(1.5, 1.3)]).fleet) is None  # half: not most
    assert mispredicted_misses(ErrorFigures()) is None


def test_figures_per_pool_and_per_instance() -> None:
    rows = [
        fact(1.0, 1.0, pool="a", inst="a0"),
        fact(2.0, 1.0, pool="a", inst="a1"),
        fact(1.0, 2.0, pool="b", inst="b0"),
        fact(1.0, None, pool="c", inst="c0"),  # no prediction: not listed
        fact(1.0, 1.0, pool=None, inst=None),  # fleet only
    ]
    r = measure(rows)
    assert r.fleet.predicted == 4
    assert sorted(r.pools) == ["a", "b"] and sorted(r.instances) == ["a0", "a1", "b0"]
    assert r.pools["a"].measured == 2 and r.pools["a"].error_p50 == pytest.approx(0.5)
    assert r.instances["a1"].error_p50 == 1.0 and r.instances["b0"].error_p50 == 0.5
    assert r.pools["a"].misses == 1 and r.pools["a"].mispredicted == 1


def test_ratio_refuses_what_is_not_a_ratio() -> None:
    assert ratio(0.6, 0.4) == pytest.approx(1.5)
    assert ratio(None, 0.4) is None and ratio(0.6, 0) is None and ratio(-1.0, 1.0) is None
    assert ratio(float("inf"), 1.0) is None and ratio("1", 1.0) is None
