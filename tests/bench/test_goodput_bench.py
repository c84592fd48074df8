"""The goodput bench's pure parts: cell selection, fault plans, oracle tables, decision analysis,
targets and the time budget (the runs themselves are the bench, not a test)."""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path

import pytest

from bench.goodput.catalogue import (
    CONTENDERS,
    FAULTS,
    FLEETS,
    HEALTHY,
    MIXES,
    OVERLOAD,
    Cell,
    fault_plan,
    select_cells,
    select_contenders,
)
from bench.goodput.decisions import analyse, is_limit_cut
from bench.goodput.oracle import oracle_schedule, oracle_table
from bench.goodput.predictor import prediction_error, read_predictions
from bench.goodput.report import budget_s, cell_targets, combine_seeds, markdown, summary, targets_line
from bench.goodput.run import parse
from bench.goodput.worker import workload
from simulator.faults import parse_fault


def test_the_full_matrix_is_four_fleets_two_loads_sixteen_faults() -> None:
    cells = select_cells()
    assert len(cells) == 4 * 2 * 16
    assert cells[0] == Cell("2p4d", 75, "degraded_decode_link")
    assert {c.fleet for c in cells} == {"2p4d", "3p6d", "4p2d", "3p3d"} and {c.load for c in cells} == {
        75,
        90,
    }
    # at least two P:D ratios
    assert len({FLEETS[f].n_p / FLEETS[f].n_d for f in FLEETS}) >= 3


def test_cells_take_names_globs_and_old_letters_in_matrix_order() -> None:
    got = select_cells("3p6d:90:burst,2p4d:75:slow_prefill")
    assert [c.name for c in got] == ["2p4d:75:slow_prefill", "3p6d:90:burst"]
    assert [c.name for c in select_cells("*:90:b", fleets="2p4d")] == ["2p4d:90:burst"]
    assert len(select_cells(faults="stuck*,bad_pair")) == 16
    assert [c.fault for c in select_cells(fleets="3p6d", loads="75", faults="a,c")] == [
        "degraded_decode_link",
        "slow_prefill",
    ]


@pytest.mark.parametrize("bad", ["2p4d:75", "9p9d:75:burst", "2p4d:75:nope"])
def test_a_cell_pattern_that_matches_nothing_is_an_error(bad: str) -> None:
    with pytest.raises(ValueError, match="--cells"):
        select_cells(bad)


def test_contenders_default_to_all_five_and_reject_unknown_names() -> None:
    assert select_contenders(None) == list(CONTENDERS)
    assert select_contenders("killed,controller") == ["controller", "killed"]
    with pytest.raises(ValueError, match="--contenders"):
        select_contenders("nobody")


@pytest.mark.parametrize("fleet", list(FLEETS))
@pytest.mark.parametrize("fault", [*FAULTS, HEALTHY])
def test_every_fault_is_a_valid_simulator_fault_on_instances_of_the_fleet(fleet: str, fault: str) -> None:
    shape = FLEETS[fleet]
    plan = fault_plan(fault, shape, 20.0)
    names = set(shape.prefills()) | set(shape.decodes())
    for spec in plan.injections:
        assert parse_fault(spec).instances() <= names
    assert plan.faulty <= names
    assert plan.limit_pools <= {"prefill", "decode"}
    assert (plan.burst is not None) == (fault in ("burst", "surge", "prefill_heavy"))
    assert plan.mix in MIXES


@pytest.mark.parametrize("fleet", list(FLEETS))
@pytest.mark.parametrize("fault", [*FAULTS, HEALTHY])
def test_every_fault_has_an_oracle_table_naming_only_fleet_instances(fleet: str, fault: str) -> None:
    shape = FLEETS[fleet]
    plan = fault_plan(fault, shape, 20.0)
    schedule = oracle_schedule(plan, shape, 14.0)
    assert schedule[0][0] is None  # a table from the start
    inst = [(n, "prefill", "prefill", "http://x") for n in shape.prefills()]
    inst += [(n, "decode", "decode", "http://y") for n in shape.decodes()]
    for _, weights, limits in schedule:
        assert set(weights) <= {n for n, *_ in inst}
        table = oracle_table(inst, weights, limits, 0.5, version=3)
        assert table["version"] == 3 and len(table["instances"]) == shape.n_p + shape.n_d
    if fault == "decode_down":
        assert schedule[1] == (plan.ends_after_s, {}, {"prefill": None, "decode": None})


def test_the_slow_prefill_oracle_weighs_the_p_by_speed_and_limits_to_a_second_of_capacity() -> None:
    shape = FLEETS["3p6d"]
    [(_, weights, limits)] = oracle_schedule(fault_plan("slow_prefill", shape, 20), shape, 21.0)
    assert weights == {"prefill-2": pytest.approx(1 / 3)}
    assert limits["prefill"] == round(21 * (2 + 1 / 3) / 3)


def test_the_burst_adds_load_up_to_one_and_a_half_capacity_from_onset() -> None:
    plan = fault_plan("burst", FLEETS["2p4d"], 20.0)
    base = workload(10.0, 14.0, 28.0, 8.0, 1, fault_plan(HEALTHY, FLEETS["2p4d"], 20.0))
    burst = workload(10.0, 14.0, 28.0, 8.0, 1, plan)
    extra = len(burst) - len(base)
    assert [x.at for x in burst] == sorted(x.at for x in burst)
    assert 55 < extra < 176  # about (1.5 x 14 - 10) req/s x 10 s = 110
    assert not [x for x in burst if x not in base and not 8.0 <= x.at <= 18.0]


def _d(ts: float, subject: str, field: str, old: float | None, new: float | None, reason: str = "R") -> dict:
    return {
        "ts": ts,
        "tick": int(ts),
        "subject": subject,
        "field": field,
        "old_value": old,
        "new_value": new,
        "reason": reason,
    }


def test_reaction_is_the_first_cut_of_the_faulty_instance_after_onset() -> None:
    plan = fault_plan("stuck_decode", FLEETS["2p4d"], 20)
    decisions = [
        _d(99.0, "decode-3", "weight", 1.0, 0.95),  # before onset: a healthy cut, but above 0.9
        _d(102.5, "decode-0", "weight", 1.0, 0.5),  # a healthy instance after onset
        _d(103.2, "decode-3", "weight", 1.0, 0.75),
        _d(104.0, "decode-3", "weight", 0.75, 0.5),
    ]
    got = analyse(decisions, plan, 100.0, 1.0)
    assert got["reaction_ticks"] == 4 and got["reaction_s"] == pytest.approx(3.2)
    assert got["healthy_weight_cuts"] == 1 and got["healthy_cut_detail"][0]["subject"] == "decode-0"
    assert got["min_weight"] == {"decode-0": 0.5, "decode-3": 0.5}


def test_a_first_limit_decision_is_a_cut_only_below_the_configured_default() -> None:
    assert not is_limit_cut(_d(1, "prefill", "max_inflight_requests", None, 256))
    assert is_limit_cut(_d(1, "prefill", "max_inflight_requests", None, 18))
    assert is_limit_cut(_d(1, "prefill", "max_inflight_requests", 256, 128))
    assert not is_limit_cut(_d(1, "prefill", "max_inflight_requests", 128, 256))
    assert not is_limit_cut(_d(1, "prefill", "max_queue_wait_s", 1.0, 0.5))


def test_limit_cuts_count_as_healthy_cuts_unless_the_fault_calls_for_that_pool() -> None:
    cut = [_d(105, "prefill", "max_inflight_requests", 256, 20)]
    assert analyse(cut, fault_plan("burst", FLEETS["2p4d"], 20), 100.0, 1.0)["healthy_cuts"] == 0
    assert analyse(cut, fault_plan("slow_prefill", FLEETS["2p4d"], 20), 100.0, 1.0)["healthy_cuts"] == 0
    assert (
        analyse(cut, fault_plan("stuck_decode", FLEETS["2p4d"], 20), 100.0, 1.0)["unexpected_limit_cuts"] == 1
    )
    early = [_d(95, "prefill", "max_inflight_requests", 256, 20)]
    assert analyse(early, fault_plan("burst", FLEETS["2p4d"], 20), 100.0, 1.0)["healthy_cuts"] == 1


def test_in_a_healthy_run_every_cut_below_the_floor_is_counted() -> None:
    decisions = [
        _d(5, "decode-1", "weight", 1.0, 0.92),
        _d(6, "decode-1", "weight", 0.92, 0.8),
        _d(7, "decode", "max_inflight_requests", 256, 64),
    ]
    got = analyse(decisions, fault_plan(HEALTHY, FLEETS["3p6d"], 600), None, 1.0)
    assert (got["healthy_weight_cuts"], got["unexpected_limit_cuts"]) == (1, 1)
    assert "reaction_ticks" not in got


def _res(**goodput: float) -> dict[str, dict]:
    return {c: {"goodput_rps": g, "ttft_p99_s": 1.5, "healthy_cuts": 0} for c, g in goodput.items()}


def test_targets_pass_miss_and_not_applicable() -> None:
    ratios, t = cell_targets(
        "slow_prefill", _res(round_robin=5, static=2, controller=9.6, oracle=10, killed=6), 2.0
    )
    assert ratios["controller_vs_static"] == 4.8 and ratios["captured_share"] == pytest.approx(7.6 / 8)
    assert {k: v["status"] for k, v in t.items()} == {
        "do_no_harm": "PASS",
        "near_oracle": "PASS",
        "captures_gain": "PASS",
        "alone_vs_rr": "PASS",
        "no_healthy_cuts": "PASS",
        "overload_attainment": "-",  # not an overload cell
        "overload_p99": "-",
        "rejections": "-",  # no rejection counts
        "predictor_median": "-",  # no predictions
        "predictor_p90": "-",
    }
    _, t = cell_targets(
        "kv_capacity", _res(round_robin=11, static=11, controller=10.7, oracle=11.2, killed=10), 2.0
    )
    assert t["do_no_harm"]["status"] == "MISS" and t["alone_vs_rr"]["status"] == "MISS"
    assert t["captures_gain"]["status"] == "-"  # the oracle's gain is under 5 %


def test_a_missing_or_failed_contender_makes_its_targets_not_applicable() -> None:
    res = _res(static=2, controller=3)
    res["oracle"] = {"error": "worker exit 1"}
    _, t = cell_targets("burst", res, 2.0)
    assert t["do_no_harm"]["status"] == "PASS"
    assert t["near_oracle"]["status"] == t["captures_gain"]["status"] == t["alone_vs_rr"]["status"] == "-"
    assert t["overload_p99"]["status"] == "PASS"
    cells = {
        "a": {"targets": t},
        "b": {"targets": cell_targets("burst", _res(static=2, controller=1), 2.0)[1]},
    }
    assert summary(cells)["do_no_harm"] == {
        "target": "controller / static >= 1.0",
        "pass": 1,
        "miss": 1,
        "missed_cells": ["b"],
    }


def test_the_docs_table_marks_misses_and_what_does_not_apply() -> None:
    res = _res(round_robin=5, static=8, controller=7, oracle=10, killed=6)
    ratios, t = cell_targets("burst", res, 2.0)
    cells = {"2p4d:90:burst": {"contenders": res, "targets": t, "ratios": ratios, "reaction_ticks": 4}}
    md = markdown({"cells": cells, "summary": summary(cells)}).splitlines()
    assert md[2] == (
        "| 2p4d:90:burst | 5.00 | 8.00 | **7.00** | 10.00 | 6.00 | 0.88 ✗ | 0.70 ✗ | -50% ✗ | 1.20 | "
        "4t | 0 | 1.50s | – | – | – |"
    )
    assert "- `do_no_harm`: 0 pass, 1 miss" in md
    _, t = cell_targets("kv_capacity", res, 2.0)  # no burst: its p99 target does not apply, no mark
    assert (
        markdown({"cells": {"c": {"contenders": res, "targets": t}}, "summary": {}})
        .splitlines()[2]
        .endswith("| – | 0 | 1.50s | – | – | – |")
    )


def test_a_static_at_zero_goodput_gives_an_infinite_gain() -> None:
    ratios, t = cell_targets("burst", _res(static=0, controller=8, oracle=10), 2.0)
    assert math.isinf(ratios["oracle_gain_over_static"]) and t["captures_gain"]["status"] == "PASS"


def test_the_budget_lays_the_runs_on_the_parallel_slots() -> None:
    runs = [("static", 8.0, 20.0), ("controller", 8.0, 20.0)]
    assert budget_s(runs, 2, 30.0) == pytest.approx(30 + 38)
    assert budget_s(runs, 1) == pytest.approx(35 + 38)
    assert budget_s([("controller", 8.0, 600.0)] * 8, 3) == pytest.approx(3 * 618)


def test_cuts_before_the_first_request_are_startup_cuts_not_healthy_cuts() -> None:
    decisions = [
        _d(1, "decode-0", "weight", 1.0, 0.0, "InstanceDown"),
        _d(2, "decode-0", "weight", 0.0, 0.02),
        _d(30, "decode-1", "weight", 1.0, 0.5),
    ]
    got = analyse(decisions, fault_plan(HEALTHY, FLEETS["2p4d"], 60), None, 1.0, load_from=10.0)
    assert (got["startup_cuts"], got["healthy_weight_cuts"], got["decisions"]) == (1, 1, 3)
    assert got["startup_cut_detail"][0]["reason"] == "InstanceDown"


@pytest.mark.parametrize("fault", ["p_down", "d_lost"])
def test_a_lost_instance_is_down_for_the_rest_of_the_phase(fault: str) -> None:
    shape = FLEETS["4p2d"]
    plan = fault_plan(fault, shape, 20.0)
    [spec] = plan.injections
    gone = shape.bad_p if fault == "p_down" else shape.bad_d
    assert spec == {"kind": "down", "instance": gone} and parse_fault(spec).duration is None
    assert plan.faulty == {gone} and plan.ends_after_s is None and fault in OVERLOAD


def test_degrade_slows_one_p_in_steps_that_multiply_to_three() -> None:
    plan = fault_plan("degrade", FLEETS["3p3d"], 30.0)
    specs = [parse_fault(s) for s in plan.injections]
    assert [s.at for s in specs] == [0.0, 10.0, 20.0] and {s.instance for s in specs} == {"prefill-2"}
    totals = [math.prod(s.factor or 1.0 for s in specs[: i + 1]) for i in range(3)]
    assert totals == pytest.approx([1.5, 2.0, 3.0])
    schedule = oracle_schedule(plan, FLEETS["3p3d"], 21.0)
    assert [at for at, *_ in schedule] == [None, 10.0, 20.0]
    assert [w["prefill-2"] for _, w, _ in schedule] == pytest.approx([1 / 1.5, 1 / 2, 1 / 3], abs=1e-4)
    assert schedule[-1][2]["prefill"] == round(21 * (2 + 1 / 3) / 3)


def test_the_p_down_oracle_gives_the_dead_p_nothing_and_limits_to_what_is_left() -> None:
    shape = FLEETS["4p2d"]
    [(_, weights, limits)] = oracle_schedule(fault_plan("p_down", shape, 20.0), shape, 28.0)
    assert weights == {"prefill-3": 0.0} and limits == {"prefill": 21, "decode": None}
    [(_, weights, _)] = oracle_schedule(fault_plan("d_lost", shape, 20.0), shape, 28.0)
    assert weights == {"decode-1": 0.0}


def test_the_surge_offers_twice_the_capacity_for_most_of_the_phase() -> None:
    plan = fault_plan("surge", FLEETS["2p4d"], 20.0)
    assert plan.burst == (2.0, 12.0)
    base = workload(10.0, 14.0, 28.0, 8.0, 1, fault_plan(HEALTHY, FLEETS["2p4d"], 20.0))
    surge = workload(10.0, 14.0, 28.0, 8.0, 1, plan)
    assert 18 * 12 * 0.7 < len(surge) - len(base) < 18 * 12 * 1.3  # (2 x 14 - 10) req/s x 12 s
    assert not [x for x in surge if x not in base and not 8.0 <= x.at <= 20.0]


def test_prefill_heavy_is_its_own_mix_over_capacity_for_the_whole_phase() -> None:
    plan = fault_plan("prefill_heavy", FLEETS["2p4d"], 20.0)
    assert plan.mix == "prefill_heavy" and plan.burst == (1.3, 20.0)
    got = workload(3.0, 4.0, 28.0, 8.0, 1, plan)
    assert all(4096 <= x.prompt_tokens <= 8192 and x.output_tokens == 8 for x in got)
    assert len({x.prompt_tokens for x in got}) > 10  # spread lengths: a request's cost is its tokens
    chat = workload(3.0, 4.0, 28.0, 8.0, 1, fault_plan("burst", FLEETS["2p4d"], 20.0))
    assert {(x.prompt_tokens, x.output_tokens) for x in chat} == {(2048, 32)}


def _full(g: float, rejections: int = 0, att: float | None = 1.0, p99: float = 1.5) -> dict:
    return {
        "goodput_rps": g,
        "ttft_p99_s": p99,
        "healthy_cuts": 0,
        "rejections": rejections,
        "admitted_attainment": att,
    }


def test_overload_targets_hold_the_admitted_requests_and_the_rejections_to_the_oracle() -> None:
    res = {"static": _full(8), "controller": _full(10, 13, 0.985, 2.1), "oracle": _full(10, 10)}
    _, t = cell_targets("p_down", res, 2.0)
    assert t["overload_attainment"]["status"] == "MISS" and t["overload_p99"]["status"] == "MISS"
    assert t["rejections"] == {"value": pytest.approx(1.3), "status": "MISS"}
    res["controller"] = _full(10, 12, 0.995, 1.9)
    _, t = cell_targets("p_down", res, 2.0)
    assert [t[k]["status"] for k in ("overload_attainment", "overload_p99", "rejections")] == ["PASS"] * 3
    _, t = cell_targets("slow_prefill", res, 2.0)  # not an overload cell: rejections still judged
    assert t["overload_attainment"]["status"] == "-" and t["rejections"]["status"] == "PASS"
    none = {"controller": _full(10, 0), "oracle": _full(10, 0)}
    assert cell_targets("surge", none, 2.0)[1]["rejections"]["status"] == "PASS"


def test_seeds_combine_into_mean_and_min_and_any_missed_seed_misses_the_cell() -> None:
    by_seed = {
        "1": {"static": _full(10), "controller": _full(11), "oracle": _full(11)},
        "2": {"static": _full(10), "controller": _full(9), "oracle": _full(10)},
    }
    got = combine_seeds("surge", by_seed, 2.0)
    assert got["contenders"]["controller"]["goodput_rps"] == pytest.approx(10.0)
    assert got["contenders"]["controller"]["goodput_rps_min"] == 9
    harm = got["targets"]["do_no_harm"]
    assert (
        harm["status"] == "MISS" and harm["value"] == pytest.approx(1.0) and harm["min"] == pytest.approx(0.9)
    )
    assert got["seeds"]["1"]["targets"]["do_no_harm"]["status"] == "PASS"
    assert "(min 0.90) MISS" in targets_line(got["targets"])
    one = combine_seeds("surge", {"1": by_seed["1"]}, 2.0)
    assert one["contenders"]["controller"] == by_seed["1"]["controller"]


def test_the_predictor_error_is_the_median_and_p90_of_the_relative_error() -> None:
    pairs = [(1.0, 1.0), (1.0, 1.1), (2.0, 1.0), (1.0, 1.2), (0.0, 1.0), (1.0, float("nan"))]
    got = prediction_error(pairs)
    assert got["n"] == 4 and got["skipped"] == 2
    assert got["median"] == pytest.approx(0.15) and got["p90"] == pytest.approx(0.41)
    assert prediction_error(None) == {"n": 0, "skipped": 0, "median": None, "p90": None, "recorded": False}


def test_predictions_are_read_from_the_store_only_where_it_records_them(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    with sqlite3.connect(tmp_path / "s.db") as db:
        db.execute("CREATE TABLE request_records (id INTEGER PRIMARY KEY, proxy_in REAL, ttft_s REAL)")
    assert read_predictions(url, 0.0) is None
    with sqlite3.connect(tmp_path / "s.db") as db:
        db.execute("ALTER TABLE request_records ADD COLUMN predicted_ttft_s REAL")
        db.executemany(
            "INSERT INTO request_records (proxy_in, ttft_s, predicted_ttft_s) VALUES (?, ?, ?)",
            [(5.0, 1.0, 0.5), (10.0, 1.2, 1.0), (11.0, None, 1.0), (12.0, 0.9, None)],
        )
    assert read_predictions(url, 10.0) == [(1.0, 1.2)]


def test_capacities_and_seeds_are_validated_at_the_command_line() -> None:
    a = parse(["--capacity", "2p4d=14,4p2d/prefill_heavy=5", "--seeds", "1,2,3"])
    assert a.capacity == {"2p4d": 14.0, "4p2d/prefill_heavy": 5.0} and a.seeds == [1, 2, 3]
    assert parse([]).seeds == [1] and parse(["--healthy"]).seeds == [1, 2]
    for bad in (["--capacity", "2p4d/nope=3"], ["--capacity", "2p4d=-1"], ["--seeds", "1,1"]):
        with pytest.raises(SystemExit):
            parse(bad)
