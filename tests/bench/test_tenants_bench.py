"""The tenants bench (issue 31): its arithmetic on made-up results (a tenant's figures, Jain's index, the
ratios against alone, the flood's 429s, the targets' verdicts), its seeded schedules and tenants sections,
and one tiny run of the whole harness (fleet tier: it starts processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.goodput.catalogue import FLEETS
from bench.goodput.stack import StackSpec
from bench.tenants.client import rejection_reason
from bench.tenants.figures import (
    TARGETS,
    Sent,
    combine,
    flood_figures,
    jain,
    run_figures,
    summary,
    tenant_figures,
    verdict,
)
from bench.tenants.report import derived, rederive, tables
from bench.tenants.scenarios import SCENARIOS, Scenario, TenantLoad, schedule, tenant_plan, tenants_section
from bench.tenants.stack import TenantStack
from pdscope.config.tenants import TenantSettings
from simulator.workload import RequestResult

REPO = Path(__file__).resolve().parents[2]
A, B = TenantLoad("a", 0.5), TenantLoad("b", 0.5, weight=2.0, ttft_ms=500.0)


def _ok(tenant: str, i: int, ttft: float, prompt: int = 100, out: int = 10, e2e: float | None = None) -> Sent:
    r = RequestResult(i, f"{tenant}-{i}", 0.0, 0.0, prompt, out, ok=True, status=200, ttft_s=ttft)
    r.e2e_s, r.output_tokens = (e2e if e2e is not None else ttft + 0.05 * (out - 1)), out
    return Sent(tenant, r)


def _429(tenant: str, i: int, reason: str) -> Sent:
    r = RequestResult(i, f"{tenant}-{i}", 0.0, 0.0, 100, 10, status=429, error="HTTP 429")
    return Sent(tenant, r, reason)


def test_a_tenants_figures_count_a_429_as_a_miss_and_its_own_slo() -> None:
    sent = [
        _ok("a", 0, 0.4),
        _ok("a", 1, 3.0),  # past a's 2 s TTFT
        _ok("a", 2, 0.2, e2e=0.2 + 0.2 * 9),  # TPOT 200 ms, past a's 100 ms
        _429("a", 3, "tenant_queue_full"),
        _429("a", 4, "tenant_queue_full"),
        _429("a", 5, "predicted_late"),
        _ok("b", 6, 0.6),  # within a's SLO, past b's 500 ms
    ]
    f = tenant_figures(sent, A, measure_s=2.0)
    assert (f["requests"], f["served"], f["rejected_429"]) == (6, 3, 3)
    assert f["rejected_by_reason"] == {"predicted_late": 1, "tenant_queue_full": 2}
    assert f["attainment"] == pytest.approx(1 / 6)
    assert f["goodput_tok_s"] == pytest.approx(110 / 2.0)  # prompt + output of the one that met it
    # service as the fair queue charges it: the prompt, each decode step and the KV held over them
    kv = 10 * 100 + 10 * 11 // 2  # 10 steps holding 100 tokens of context and one more after each
    assert f["service_tok_s"] == pytest.approx(3 * (110 + kv / 2048) / 2.0)
    g = tenant_figures(sent, B, measure_s=2.0)
    assert g["attainment"] == 0.0 and g["weighted_service"] == pytest.approx((110 + kv / 2048) / 2.0 / 2.0)


def test_jains_index() -> None:
    assert jain([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    # equal offered loads under weights 2:1:1 served in proportion to demand: (0.5, 1, 1) after weighting
    assert jain([0.5, 1.0, 1.0]) == pytest.approx(6.25 / 6.75)
    assert jain([]) is None and jain([0.0, 0.0]) is None


def test_rejection_reason_is_the_error_bodys_code() -> None:
    body = b'{"error": {"message": "m", "type": "rate_limit_error", "code": "shed_for_priority"}}'
    assert rejection_reason(429, body) == "shed_for_priority"
    assert rejection_reason(429, b"not json") == "HTTP 429"
    assert rejection_reason(503, b'{"error": {"code": null}}') == "HTTP 503"
    assert rejection_reason(429, b"[1]") == "HTTP 429"


def test_schedules_are_seeded_per_tenant_and_the_same_alone() -> None:
    sc = SCENARIOS["flood"]
    together = schedule(sc, 20.0, 30.0, seed=3)
    assert together == schedule(sc, 20.0, 30.0, seed=3) != schedule(sc, 20.0, 30.0, seed=4)
    alone = schedule(sc, 20.0, 30.0, 3, only="alpha")
    assert [p for t, p in together if t == "alpha"] == [p for _, p in alone]
    assert [p.at for _, p in together] == sorted(p.at for _, p in together)
    for t in sc.tenants:
        plan = tenant_plan(t, 20.0, 200.0, seed=1)
        assert len(plan) == pytest.approx(t.of_capacity * 20.0 * 200.0, rel=0.15)
        assert all(64 <= p.prompt_tokens <= 6144 and 4 <= p.output_tokens <= 128 for p in plan)
        assert len({p.prompt_tokens for p in plan}) > 10  # mixed lengths
    # the flood asks 5x its share, the others less than theirs
    assert sc.tenant("flood").of_capacity / sc.share(sc.tenant("flood")) == pytest.approx(5.0)
    assert all(t.of_capacity < sc.share(t) for t in sc.behaved())


def test_shapes_gives_each_tenant_its_own_lengths_and_its_fleet_bounds_d(tmp_path: Path) -> None:
    """``shapes``: the writer's outputs are its own (median about 150, past the mix's 128, at most 512),
    the rag tenant's prompts its own, and the run's config takes the scenario's fleet knobs."""
    sc = SCENARIOS["shapes"]
    writer = tenant_plan(sc.tenant("writer"), 20.0, 200.0, seed=1)
    outs = sorted(p.output_tokens for p in writer)
    assert 120 <= outs[len(outs) // 2] <= 180 and outs[-1] <= 512 and any(o > 128 for o in outs)
    rag = tenant_plan(sc.tenant("rag"), 20.0, 200.0, seed=1)
    assert sorted(p.prompt_tokens for p in rag)[len(rag) // 2] == pytest.approx(4000, rel=0.1)
    assert all(p.output_tokens <= 128 for p in rag)
    assert sc.fleet is not None
    spec = StackSpec(FLEETS["2p4d"], "static", 1, 5.0)
    config = yaml.safe_load(
        TenantStack(spec, tmp_path, tenants_section(sc, True), fleet=sc.fleet).config.read_text()
    )
    assert config["proxy"]["admission"]["max_inflight_requests"] == sc.fleet.pool_slots
    assert config["simulator"]["decode_per_seq_s"] == sc.fleet.decode_per_seq_s
    (tmp_path / "plain").mkdir()
    plain = yaml.safe_load(
        TenantStack(spec, tmp_path / "plain", tenants_section(sc, True)).config.read_text()
    )
    assert plain["proxy"]["admission"]["max_inflight_requests"] == 256


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("enabled", [True, False])
def test_every_scenarios_tenants_section_is_valid_config(name: str, enabled: bool) -> None:
    s = TenantSettings.model_validate(tenants_section(SCENARIOS[name], enabled))
    assert s.enabled is enabled and set(s.tenants) == {"default", *(t.id for t in SCENARIOS[name].tenants)}
    assert s.header == "x-pdscope-tenant"


def _run(per: dict[str, tuple[float | None, int, float | None]], jain_: float | None, goodput: float) -> Any:
    """A run's figures: per tenant (attainment, 429s, TTFT p99)."""
    return {
        "tenants": {
            k: {"attainment": a, "rejected_429": n, "ttft_p99_s": p99, "goodput_tok_s": 0.0}
            for k, (a, n, p99) in per.items()
        },
        "jain": jain_,
        "goodput_tok_s": goodput,
    }


def _runs() -> dict[str, dict[str, Any]]:
    flood = {
        "fair": _run({"alpha": (0.99, 0, 1.0), "beta": (0.97, 1, 1.0), "flood": (0.2, 80, 3.0)}, None, 100.0),
        "unfair": _run({"alpha": (0.6, 9, 2.0), "beta": (0.7, 5, 2.0), "flood": (0.3, 70, 2.0)}, None, 102.0),
        "alone:alpha": _run({"alpha": (1.0, 0, 0.5)}, None, 50.0),
        "alone:beta": _run({"beta": (0.98, 1, 0.5)}, None, 50.0),
    }
    prio = {
        "fair": _run({"chat": (1.0, 0, 1.2), "batch": (0.5, 50, 5.0)}, None, 200.0),
        "unfair": _run({"chat": (0.5, 10, 2.5), "batch": (0.5, 40, 5.0)}, None, 200.0),
        "alone:chat": _run({"chat": (1.0, 0, 0.4)}, None, 50.0),
    }
    backlog = {
        "fair": _run({}, 0.99, 300.0),
        "unfair": _run({}, 0.926, 300.0),
    }
    return {"flood": flood, "priority": prio, "backlog": backlog}


def test_summary_holds_each_figure_against_its_target_beside_the_baseline() -> None:
    runs = _runs()
    rows = {r["key"]: r for r in summary(runs, SCENARIOS, 0.95)}
    a = rows["attainment_vs_alone"]
    assert a["measured"] == pytest.approx(0.97 / 0.98) and a["verdict"] == "PASS (edge)"
    assert a["baseline"] == pytest.approx(0.5)  # the worst: chat's 0.5 beside a contending batch
    assert rows["jain_backlogged"]["verdict"] == "PASS" and rows["jain_backlogged"]["baseline"] == 0.926
    flood_row = rows["flood_share_of_excess_429"]  # beta's one 429 it had alone too: not the flood's excess
    assert flood_row["measured"] == 1.0 and flood_row["verdict"] == "PASS"
    assert flood_row["baseline"] == pytest.approx(70 / (70 + 9 + 4))
    assert rows["interactive_p99_ttft_vs_slo"]["measured"] == pytest.approx(1200 / 1500)
    assert rows["goodput_fair_vs_unfair"]["measured"] == pytest.approx(100 / 102)  # the worst scenario
    assert rows["ceiling_on_vs_off"]["verdict"] == "PASS"
    assert [r["key"] for r in summary(runs, SCENARIOS, None)][-1] == "ceiling_on_vs_off"
    assert summary(runs, SCENARIOS, None)[-1]["verdict"] == "n/a"
    flood = flood_figures(runs["flood"], SCENARIOS["flood"], "fair")
    assert flood["flood_share_of_429"] == pytest.approx(80 / 81)
    assert flood["others_excess_429"] == {"alpha": 0, "beta": 0} and flood["excess_share"] == 1.0
    d = derived(runs, SCENARIOS)
    assert d["priority"]["unfair"]["attainment_vs_alone"] == {"chat": 0.5}
    assert d["backlog"]["goodput_fair_vs_unfair"] == 1.0


def test_repeated_runs_are_judged_on_their_median_and_show_their_range() -> None:
    runs = _runs()
    worse, better = _runs(), _runs()
    worse["flood"]["fair"]["tenants"]["beta"]["attainment"] = 0.80
    better["flood"]["fair"]["tenants"]["beta"]["attainment"] = 0.98
    better["flood"]["unfair"]["goodput_tok_s"] = 80.0  # fair over unfair 1.25 there: the worst is 1.0
    rows = {r["key"]: r for r in combine([summary(r, SCENARIOS, 0.95) for r in (runs, worse, better)])}
    a = rows["attainment_vs_alone"]
    assert a["repeats"] == 3 and a["measured"] == pytest.approx(0.97 / 0.98)  # the median of the three
    assert a["measured_range"] == [pytest.approx(0.80 / 0.98), pytest.approx(0.99)]  # beta's worst, alpha's
    assert a["verdict"] == "PASS (edge)" and a["baseline_range"] == [0.5, 0.5]
    g = rows["goodput_fair_vs_unfair"]
    assert g["measured"] == pytest.approx(100 / 102) and g["measured_range"][1] == pytest.approx(1.0)
    assert "priority" not in g  # no priority arm ran
    one = summary(runs, SCENARIOS, 0.95)
    assert combine([one]) == one
    text = tables(
        {
            "capacity": {"capacity_rps": 1.0, "given": True},
            "fleet": "f",
            "warm_s": 1,
            "measure_s": 1,
            "runs": {},
            "summary": list(rows.values()),
        }
    )
    assert "0.990 [0.816, 0.990]" in text and "median of 3 repeated runs" in text


def test_a_repeated_result_is_derived_again_over_every_repeat() -> None:
    first, later = _runs(), _runs()
    later["flood"]["fair"]["tenants"]["beta"]["attainment"] = 0.49
    contested = {
        n: {arm: r for arm, r in runs.items() if not arm.startswith("alone:")} for n, runs in later.items()
    }
    result = {"runs": first, "repeat_runs": [contested], "ceiling": {"ratio_on_vs_off": 0.95}}
    rows = {r["key"]: r for r in rederive(result)["summary"]}
    a = rows["attainment_vs_alone"]
    assert a["repeats"] == 2 and a["measured_range"] == [
        pytest.approx(0.49 / 0.98),
        pytest.approx(0.97 / 0.98),
    ]
    assert rederive({"runs": first})["summary"] == summary(first, SCENARIOS, None)  # one repeat: as before


def test_verdicts_and_their_edges() -> None:
    at_least = next(t for t in TARGETS if t.key == "jain_backlogged")
    at_most = next(t for t in TARGETS if t.key == "interactive_p99_ttft_vs_slo")
    assert [verdict(at_least, v) for v in (0.94, 0.95, 0.96, 0.99, None)] == [
        "MISS",
        "PASS (edge)",
        "PASS (edge)",
        "PASS",
        "n/a",
    ]
    assert [verdict(at_most, v) for v in (1.01, 1.0, 0.99, 0.9)] == [
        "MISS",
        "PASS (edge)",
        "PASS (edge)",
        "PASS",
    ]


def test_run_figures_keep_a_tenant_that_sent_nothing_and_only_the_one_alone() -> None:
    sc = Scenario("x", "", (A, B))
    out = run_figures([_ok("a", 0, 0.1)], sc, 1.0)
    assert out["tenants"]["b"]["requests"] == 0 and out["tenants"]["b"]["attainment"] is None
    assert out["tenants"]["b"]["ttft_p99_s"] is None and out["jain"] == pytest.approx(1 / 2)
    assert list(run_figures([_ok("a", 0, 0.1)], sc, 1.0, only="a")["tenants"]) == ["a"]


def test_withconfig_runs_the_command_on_its_config_with_the_tenants_section(tmp_path: Path) -> None:
    config = tmp_path / "proxy.yaml"
    config.write_text(yaml.safe_dump({"model": {"name": "m"}, "proxy": {"port": 1}}))
    section = tenants_section(SCENARIOS["flood"], True)
    show = "import sys; print(open(sys.argv[2]).read())"  # argv: -c --config FILE
    cmd = [sys.executable, str(REPO / "bench/tenants/withconfig.py"), json.dumps(section)]
    cmd += [sys.executable, "-c", show, "--config", str(config)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout
    assert yaml.safe_load(out) == {"model": {"name": "m"}, "proxy": {"port": 1}, "tenants": section}
    assert yaml.safe_load(config.read_text()) == {"model": {"name": "m"}, "proxy": {"port": 1}}


@pytest.mark.fleet
@pytest.mark.timeout(240)
def test_a_tiny_run_of_the_whole_harness(tmp_path: Path) -> None:
    out = tmp_path / "tenants.json"
    argv = ["--scenarios", "flood", "--steps", "0.5", "--capacity-s", "3", "--warm", "1", "--measure", "3"]
    argv += ["--ceiling-rounds", "1", "--ceiling-duration", "1", "--repeat", "2", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.tenants", *argv], cwd=REPO, capture_output=True, text=True, timeout=200
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["runs"]["flood"]) == {"fair", "unfair", "alone:alpha", "alone:beta"}
    assert [set(r["flood"]) for r in result["repeat_runs"]] == [{"fair", "unfair"}]  # the alone runs once
    assert all(row["repeats"] == 2 for row in result["summary"])
    fair = result["runs"]["flood"]["fair"]["tenants"]
    assert set(fair) == {"alpha", "beta", "flood"} and all(f["requests"] > 0 for f in fair.values())
    assert result["ceiling"]["ratio_on_vs_off"] is not None
    assert result["capacity"]["steps"] and result["capacity"]["capacity_rps"] > 0
    assert len(result["summary"]) == len(TARGETS)
    assert "| figure | target |" in proc.stdout
    assert tables(result) in proc.stdout
