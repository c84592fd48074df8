"""The controller's scrape-time families (``controller.metrics.ControllerCollector``) render exactly
as recorded: names, help texts, labels and values of a leader with a shadow, alerts, limits and an
observation, and of a standby with none of them (with and without an observation).

The expected expositions are in ``tests/fixtures/metrics``; the lines are compared sorted, so a
change in the order of families alone does not fail, a changed help text or label does.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from analysis.tenants import TenantFigures, TenantWindow
from controller.metrics import ControllerCollector

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "metrics"


def _instance(name: str, pool: str, role: str) -> Any:
    return NS(name=name, pool=pool, role=role)


def _pool(name: str, role: str, weight: float, limits: bool) -> Any:
    return NS(
        name=name,
        role=role,
        weight=weight,
        max_inflight_requests=40 if limits else None,
        max_inflight_kv_bytes=4096 if limits else None,
        max_queue_wait_s=0.75 if limits else None,
    )


def _alert(rule: str, state: str, **labels: str) -> Any:
    return NS(rule=rule, state=state, severity="page", labels=labels)


def _leader() -> Any:
    table = NS(
        enforce=True,
        version=12,
        instances=[_instance("p0", "prefill", "prefill"), _instance("d0", "decode", "decode")],
        pools=[_pool("prefill", "prefill", 1.0, True), _pool("decode", "decode", 0.5, False)],
    )
    served = {
        "d0": NS(source="override", weight=0.25, policy_weight=0.5, drained=True),
        "p0": NS(source="policy", weight=1.0, policy_weight=1.0, drained=False),
        "gone": NS(source="policy", weight=1.0, policy_weight=1.0, drained=False),  # not in the table
    }
    active = (
        _alert("instance_down", "firing", instance="d0"),
        _alert("instance_down", "pending", instance="p0", pool="prefill"),
        _alert("slo_burn", "firing"),
    )
    tenants = TenantWindow(
        0.0,
        300.0,
        (
            TenantFigures("default", 1.0, "interactive", 2.0, 0.1),  # nothing served: no attainment
            TenantFigures(
                "team-a",
                2.0,
                "interactive",
                0.5,
                0.1,
                served=40,
                met=30,
                goodput_tokens_per_s=250.0,
                service_share=0.75,
            ),
        ),
        jain=0.9,
    )
    obs = NS(untrusted_records=3, slo=NS(attainment=0.875, goodput_rps=12.5), tenants=tenants)
    return NS(
        table=table,
        served=served,
        last=NS(alerts=NS(active=active)),
        obs=obs,
        ticks=40,
        failed_ticks=2,
        last_ok=1700000000.5,
        tick_seconds=0.125,
        role="leader",
        epoch=3,
        leader=None,
        takeovers=1,
        deposed=0,
        tick_record_bytes=2048,
        window_reads=(("slo", 3, 120), ("evidence", 2, 121)),
        full_collections=(8, 1.75),
    )


def _standby(observed: bool) -> Any:
    table = NS(enforce=False, version=0, instances=[], pools=[])
    leader = NS(mode="enforce", epoch=4)
    return NS(
        table=table,
        served={},
        last=None,
        obs=NS(untrusted_records=0, slo=NS(attainment=None, goodput_rps=0.0), tenants=None)
        if observed
        else None,
        ticks=0,
        failed_ticks=0,
        last_ok=None,
        tick_seconds=None,
        role="standby",
        epoch=None,
        leader=leader,
        takeovers=0,
        deposed=2,
        tick_record_bytes=None,
        window_reads=tuple((w, 0, 0) for w in ("slo", "evidence", "snapshots", "tenants")),
        full_collections=(0, 0.0),
    )


def _reconciler(case: str) -> Any:
    leading = case == "leader"
    shadow = {
        "ticks": 40,
        "divergent_ticks": 5,
        "failures": 1,
        "weights": {"p0": {"shadow": 0.75, "live": 1.0}, "d0": {"shadow": 0.5, "live": 0.25}},
    }
    rules = [NS(name="instance_down"), NS(name="slo_burn"), NS(name="handoff_slow")]
    return NS(
        view=_leader if leading else (lambda: _standby(case == "standby")),
        shadow_status=lambda: shadow if leading else None,
        mode="advisory",
        rules=rules,
        bundler=NS(written=2, failed=1, dropped=0, pending=1)
        if leading
        else NS(written=0, failed=0, dropped=0, pending=0),
    )


def _render(case: str) -> list[str]:
    leading = case == "leader"
    notifier = NS(sent=7, failed=1, dropped=2) if leading else NS(sent=0, failed=0, dropped=0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ControllerCollector(_reconciler(case), cast(Any, notifier)))
    return sorted(generate_latest(registry).decode().splitlines())


@pytest.mark.parametrize("case", ["leader", "standby", "unobserved"])
def test_the_controller_families_render_as_recorded(case: str) -> None:
    """``unobserved``: a standby before its first observation (no SLO families at all)."""
    expected = (FIXTURES / f"controller_{case}.prom").read_text(encoding="utf-8").splitlines()
    assert _render(case) == expected
