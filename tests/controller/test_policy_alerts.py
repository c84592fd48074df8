"""Alert rules and the inactive -> pending -> firing -> resolved state machine, on a virtual clock."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from analysis.tenants import TenantFigures, TenantWindow
from controller.policy import AlertConfig, Observation, PolicyConfig, SLOFigures
from controller.policy.alerts import AlertState, default_rules, fingerprint, step_alerts
from tests.controller.replay import T0, fleet

CFG = PolicyConfig.defaults(
    ttft_target_s=2.0, tpot_target_s=0.1, goodput_attainment=0.9, handoff_budget_s=1.0, stale_after_s=15.0
)
GOOD_SLO = SLOFigures(
    window_s=300,
    completed=100,
    met=99,
    ttft_at_slo_s=0.5,
    tpot_at_slo_s=0.05,
    handoff_p99_s=0.2,
    goodput_rps=0.33,
)


def obs(
    t: float, *, slo: SLOFigures = GOOD_SLO, newest: float | None = -1.0, **inst: dict[str, object]
) -> Observation:
    insts = tuple(replace(i, **inst.get(i.name.replace("-", "_"), {})) for i in fleet())
    return Observation(
        now=T0 + t,
        window_s=30,
        instances=insts,
        slo=slo,
        newest_data=None if newest is None else T0 + t + newest,
    )


def run(timeline: list[tuple[float, Observation]], ac: AlertConfig) -> list[dict[str, str]]:
    """Per step: {alertname[/instance]: state} of every alert that changed or is active."""
    rules = default_rules(ac)
    prev: dict[str, AlertState] = {}
    history = []
    for _, o in timeline:
        step = step_alerts(rules, o, CFG, ac, prev)
        prev = {a.fingerprint: a for a in step.active}
        states = {}
        for a in (*step.active, *step.changed):
            key = a.rule + ("/" + a.labels["instance"] if "instance" in a.labels else "")
            states[key] = a.state
        history.append(states)
    return history


@dataclass(frozen=True)
class Case:
    name: str
    steps: list[tuple[float, Observation]]
    key: str
    expect: list[str | None]  # state of ``key`` per step (None = not present)
    for_s: dict[str, float] | None = None


def every(seconds: float, n: int, make) -> list[tuple[float, Observation]]:  # type: ignore[no-untyped-def]
    return [(i * seconds, make(i * seconds, i)) for i in range(n)]


def ttft(i: int) -> SLOFigures:
    return replace(GOOD_SLO, ttft_at_slo_s=3.0)


CASES = [
    Case(
        "TTFT over target: pending, firing after `for`, resolved when it clears",
        every(10, 10, lambda t, i: obs(t, slo=replace(GOOD_SLO, ttft_at_slo_s=3.0 if 1 <= i <= 7 else 0.5))),
        "TTFTOverTarget",
        [None, "pending", "pending", "pending", "firing", "firing", "firing", "firing", "resolved", None],
        {"TTFTOverTarget": 30.0},
    ),
    Case(
        "pending that clears before `for` goes inactive, never fires",
        every(10, 5, lambda t, i: obs(t, slo=replace(GOOD_SLO, ttft_at_slo_s=3.0 if i in (1, 2) else 0.5))),
        "TTFTOverTarget",
        [None, "pending", "pending", "inactive", None],
        {"TTFTOverTarget": 30.0},
    ),
    Case(
        "too few requests: the SLO rule abstains and holds its state",
        every(
            10,
            5,
            lambda t, i: obs(t, slo=replace(GOOD_SLO, ttft_at_slo_s=3.0, completed=100 if i < 2 else 3)),
        ),
        "TTFTOverTarget",
        ["firing", "firing", "firing", "firing", "firing"],
        {"TTFTOverTarget": 0.0},
    ),
    Case(
        "goodput attainment under target",
        every(10, 3, lambda t, i: obs(t, slo=replace(GOOD_SLO, met=50))),
        "GoodputAttainmentLow",
        ["pending", "pending", "firing"],
        {"GoodputAttainmentLow": 20.0},
    ),
    Case(
        "TPOT over target",
        every(10, 2, lambda t, i: obs(t, slo=replace(GOOD_SLO, tpot_at_slo_s=0.3))),
        "TPOTOverTarget",
        ["firing", "firing"],
        {"TPOTOverTarget": 0.0},
    ),
    Case(
        "expired leases fire at once and resolve when the window is clean",
        every(2, 4, lambda t, i: obs(t, prefill_1={"expired_leases_per_min": 2.0 if i < 2 else 0.0})),
        "KVLeaseExpired/prefill-1",
        ["firing", "firing", "resolved", None],
    ),
    Case(
        "failed NIXL transfers",
        every(2, 2, lambda t, i: obs(t, decode_0={"failed_transfers_per_min": 1.0})),
        "NixlTransferFailures/decode-0",
        ["firing", "firing"],
    ),
    Case(
        "KV usage above 95% for 30 s",
        every(10, 5, lambda t, i: obs(t, decode_3={"kv_usage": 0.97})),
        "KVCacheNearlyFull/decode-3",
        ["pending", "pending", "pending", "firing", "firing"],
    ),
    Case(
        "KV usage at 95% exactly is fine",
        every(10, 2, lambda t, i: obs(t, decode_3={"kv_usage": 0.95})),
        "KVCacheNearlyFull/decode-3",
        [None, None],
    ),
    Case(
        "instance down",
        every(5, 4, lambda t, i: obs(t, decode_1={"up": False})),
        "InstanceDown/decode-1",
        ["pending", "pending", "firing", "firing"],
    ),
    Case(
        "handoff p99 over budget",
        every(10, 5, lambda t, i: obs(t, slo=replace(GOOD_SLO, handoff_p99_s=1.5))),
        "HandoffP99OverBudget",
        ["pending", "pending", "pending", "firing", "firing"],
    ),
    Case(
        "stale data: collector behind fires; instance alerts hold",
        every(
            10, 4, lambda t, i: obs(t, newest=-1.0 if i == 0 else -(10.0 + 10 * i), decode_1={"up": False})
        ),
        "CollectorBehind",
        [None, "pending", "firing", "firing"],
    ),
    Case(
        "stale data holds an instance alert instead of resolving it",
        every(
            10, 4, lambda t, i: obs(t, newest=-1.0 if i < 2 else -100.0, decode_1={"up": i != 1})
        ),  # "up" again, but seen only in stale data
        "InstanceDown/decode-1",
        [None, "firing", "firing", "firing"],
        {"InstanceDown": 0.0},
    ),
    Case(
        "no snapshots at all is stale",
        every(10, 2, lambda t, i: obs(t, newest=None)),
        "CollectorBehind",
        ["firing", "firing"],
        {"CollectorBehind": 0.0},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_alert_state_machine(case: Case) -> None:
    ac = AlertConfig(for_s=case.for_s or {})
    history = run(case.steps, ac)
    assert [h.get(case.key) for h in history] == case.expect


def test_notifications_fire_resend_and_resolve() -> None:
    ac = AlertConfig(for_s={"InstanceDown": 0.0}, resend_s=60.0)
    rules = default_rules(ac)
    prev: dict[str, AlertState] = {}
    sent: list[tuple[float, str]] = []
    for i in range(40):
        t = i * 5.0
        o = obs(t, decode_1={"up": not (i < 30)})
        step = step_alerts(rules, o, CFG, ac, prev)
        prev = {a.fingerprint: a for a in step.active}
        sent.extend((t, a.state) for a in step.notify)
    assert sent[0] == (0.0, "firing")
    assert (60.0, "firing") in sent and (120.0, "firing") in sent, "re-sent every resend_s while firing"
    assert sent[-1] == (150.0, "resolved")
    assert len(sent) == 4


def test_fingerprint_is_stable_and_label_sensitive() -> None:
    a = fingerprint("InstanceDown", {"instance": "decode-1", "pool": "decode"})
    assert a == fingerprint("InstanceDown", {"pool": "decode", "instance": "decode-1"})
    assert a != fingerprint("InstanceDown", {"instance": "decode-2", "pool": "decode"})


def test_alert_description_names_the_numbers() -> None:
    ac = AlertConfig(for_s={"TTFTOverTarget": 0.0})
    step = step_alerts(default_rules(ac), obs(0, slo=replace(GOOD_SLO, ttft_at_slo_s=3.0)), CFG, ac, {})
    a = next(a for a in step.active if a.rule == "TTFTOverTarget")
    assert "3000 ms > target 2000 ms" in a.description and a.severity == "warning"


# -- overrides from the config file -------------------------------------------------------


def test_rule_names_agree_with_the_config_list() -> None:
    from pdscope.config import ALERT_RULE_NAMES

    assert tuple(r.name for r in default_rules(AlertConfig())) == ALERT_RULE_NAMES


def test_unknown_rule_names_in_code_built_config_are_refused() -> None:
    with pytest.raises(ValueError, match="TTFTOverTraget"):
        AlertConfig(for_s={"TTFTOverTraget": 0.0})
    with pytest.raises(ValueError, match="Nope"):
        AlertConfig(disabled=frozenset({"Nope"}))


def test_from_settings_carries_the_alerts_section() -> None:
    from pdscope.config import parse_config
    from tests.pdscope.test_config_alerts import OVERRIDES

    ac = AlertConfig.from_settings(parse_config(OVERRIDES))
    assert (ac.resend_s, ac.min_requests, ac.kv_full) == (30.0, 5, 0.9)
    assert ac.for_s == {"KVLeaseExpired": 0.0, "TTFTOverTarget": 120.0}
    assert ac.severity == {"TTFTOverTarget": "critical"}
    assert ac.disabled == frozenset({"HandoffP99OverBudget"})
    rules = {r.name: r for r in default_rules(ac)}
    assert (rules["TTFTOverTarget"].severity, rules["TTFTOverTarget"].for_s) == ("critical", 120.0)
    assert rules["HandoffP99OverBudget"].enabled is False
    # rules not named keep their defaults
    assert (rules["InstanceDown"].severity, rules["InstanceDown"].for_s, rules["InstanceDown"].enabled) == (
        "critical",
        10.0,
        True,
    )
    assert AlertConfig.from_settings(parse_config(OVERRIDES.split("slo:")[0])) == AlertConfig()


def test_severity_and_for_overrides_change_when_and_how_loud() -> None:
    timeline = every(10, 8, lambda t, i: obs(t, slo=replace(GOOD_SLO, ttft_at_slo_s=3.0)))
    default = run(timeline, AlertConfig())
    longer = run(
        timeline, AlertConfig(for_s={"TTFTOverTarget": 30.0}, severity={"TTFTOverTarget": "critical"})
    )
    assert [h.get("TTFTOverTarget") for h in default] == ["pending"] * 6 + ["firing"] * 2  # default for: 60 s
    assert [h.get("TTFTOverTarget") for h in longer] == ["pending"] * 3 + ["firing"] * 5
    ac = AlertConfig(for_s={"TTFTOverTarget": 0.0}, severity={"TTFTOverTarget": "info"})
    step = step_alerts(default_rules(ac), timeline[0][1], CFG, ac, {})
    assert [(a.rule, a.severity, a.state) for a in step.notify] == [("TTFTOverTarget", "info", "firing")]


def test_a_disabled_rule_never_fires() -> None:
    timeline = every(10, 5, lambda t, i: obs(t, slo=replace(GOOD_SLO, handoff_p99_s=1.5)))
    on = run(timeline, AlertConfig(for_s={"HandoffP99OverBudget": 0.0}))
    off = run(
        timeline,
        AlertConfig(for_s={"HandoffP99OverBudget": 0.0}, disabled=frozenset({"HandoffP99OverBudget"})),
    )
    assert [h.get("HandoffP99OverBudget") for h in on] == ["firing"] * 5
    assert [h.get("HandoffP99OverBudget") for h in off] == [None] * 5


def test_disabling_a_rule_resolves_its_firing_alert_and_a_new_severity_applies() -> None:
    """State carried over a restart with a changed config: no alert is left firing forever."""
    before = AlertConfig(for_s={"InstanceDown": 0.0, "KVCacheNearlyFull": 0.0})
    o = obs(0, decode_1={"up": False}, decode_3={"kv_usage": 0.99})
    prev = {a.fingerprint: a for a in step_alerts(default_rules(before), o, CFG, before, {}).active}
    assert {(a.rule, a.state, a.severity) for a in prev.values()} == {
        ("InstanceDown", "firing", "critical"),
        ("KVCacheNearlyFull", "firing", "warning"),
    }
    after = AlertConfig(
        for_s={"KVCacheNearlyFull": 0.0},
        disabled=frozenset({"InstanceDown"}),
        severity={"KVCacheNearlyFull": "critical"},
    )
    step = step_alerts(
        default_rules(after), obs(10, decode_1={"up": False}, decode_3={"kv_usage": 0.99}), CFG, after, prev
    )
    assert [(a.rule, a.state) for a in step.notify if a.rule == "InstanceDown"] == [
        ("InstanceDown", "resolved")
    ]
    assert [(a.rule, a.severity) for a in step.active] == [("KVCacheNearlyFull", "critical")]


# -- TTFTMispredicted: the fleet changed under the proxy's TTFT predictor --------------------


def _mispredicted(slo: SLOFigures, ac: AlertConfig) -> tuple[str | None, str]:
    step = step_alerts(default_rules(ac), obs(0, slo=slo), CFG, ac, {})
    alert = next((a for a in step.active if a.rule == "TTFTMispredicted"), None)
    return (alert.state, alert.description) if alert is not None else (None, "")


NOW_ALERT = AlertConfig(for_s={"TTFTMispredicted": 0.0})


def test_ttft_mispredicted_fires_when_the_median_error_is_over_the_threshold() -> None:
    state, text = _mispredicted(replace(GOOD_SLO, predictions=80, prediction_error_p50=0.45), NOW_ALERT)
    assert state == "firing"
    assert "median 45% > 30%" in text and "over 80 requests" in text
    # a threshold of the alerts section moves it
    looser = replace(NOW_ALERT, mispredicted_error=0.5)
    assert _mispredicted(replace(GOOD_SLO, predictions=80, prediction_error_p50=0.45), looser)[0] is None


@pytest.mark.parametrize(
    ("predictions", "error"),
    [(80, 0.3), (80, 0.05), (49, 0.9), (0, None), (80, None)],
)
def test_ttft_mispredicted_stays_quiet_on_a_good_predictor_or_too_few_records(
    predictions: int, error: float | None
) -> None:
    slo = replace(GOOD_SLO, predictions=predictions, prediction_error_p50=error)
    assert _mispredicted(slo, NOW_ALERT)[0] is None


def test_ttft_mispredicted_holds_its_state_when_it_cannot_judge() -> None:
    timeline = [
        (0.0, obs(0, slo=replace(GOOD_SLO, predictions=80, prediction_error_p50=0.6))),
        (10.0, obs(10, slo=replace(GOOD_SLO, predictions=10, prediction_error_p50=0.0))),
        (20.0, obs(20, slo=replace(GOOD_SLO, predictions=80, prediction_error_p50=0.1))),
    ]
    states = [h.get("TTFTMispredicted") for h in run(timeline, NOW_ALERT)]
    assert states == ["firing", "firing", "resolved"]


def test_the_alerts_section_sets_the_mispredicted_threshold_and_minimum() -> None:
    from pdscope.config import ConfigError, parse_config
    from tests.pdscope.test_config import MINIMAL

    text = MINIMAL + "alerts:\n  mispredicted_error: 0.5\n  mispredicted_min_records: 200\n"
    ac = AlertConfig.from_settings(parse_config(text))
    assert (ac.mispredicted_error, ac.mispredicted_min_records) == (0.5, 200)
    assert (AlertConfig().mispredicted_error, AlertConfig().mispredicted_min_records) == (0.3, 50)
    for bad in ("mispredicted_error: 0", "mispredicted_min_records: 0"):
        with pytest.raises(ConfigError, match=bad.split(":")[0]):
            parse_config(MINIMAL + f"alerts:\n  {bad}\n", "f.yaml")


# -- StrandedKV ------------------------------------------------------------------------------------------

IDLE_HOLDING = dict(
    kv_usage=0.12, num_running=0.0, num_waiting=0.0, unpulled_handoffs=3, unpulled_ids=("r1", "r2")
)
NOBODY_PULLS = dict(pulls_pending=0.0)


def _stranded(t: float = 0.0, **inst: dict[str, object]) -> dict[str, str]:
    """StrandedKV's alerts (instance -> state) on one observation, ``for`` 0."""
    ds = {f"decode_{i}": NOBODY_PULLS for i in range(4)}
    ac = AlertConfig(for_s={"StrandedKV": 0.0})
    step = step_alerts(default_rules(ac), obs(t, **(ds | inst)), CFG, ac, {})
    return {a.labels["instance"]: a.description for a in step.active if a.rule == "StrandedKV"}


def test_stranded_kv_fires_for_an_idle_p_holding_kv_while_no_d_waits_to_pull() -> None:
    fired = _stranded(prefill_0=IDLE_HOLDING)
    assert list(fired) == ["prefill-0"]
    text = fired["prefill-0"]
    assert "12.0% of its KV blocks held while idle" in text and "3 handoff(s)" in text and "r1, r2" in text


@pytest.mark.parametrize(
    ("p", "d0"),
    [
        (IDLE_HOLDING | {"num_running": 1.0}, NOBODY_PULLS),  # P prefills: its blocks are its own
        (IDLE_HOLDING | {"num_waiting": 2.0}, NOBODY_PULLS),
        (IDLE_HOLDING | {"kv_usage": 0.0}, NOBODY_PULLS),  # nothing held
        (IDLE_HOLDING | {"num_running": None}, NOBODY_PULLS),  # P's gauges unknown
        (IDLE_HOLDING, {"pulls_pending": 1.0}),  # a D waits to pull: it may be P's
        (IDLE_HOLDING, {"pulls_pending": None}),  # a D's gauges are missing: it might be waiting
        (IDLE_HOLDING | {"up": False}, NOBODY_PULLS),
    ],
)
def test_stranded_kv_stays_quiet_unless_every_part_of_the_rule_holds(
    p: dict[str, object], d0: dict[str, object]
) -> None:
    assert _stranded(prefill_0=p, decode_0=d0) == {}


def test_stranded_kv_ignores_a_down_d_and_a_held_d_and_says_when_no_handoff_went_unserved() -> None:
    # a D that is down waits for nothing; a D holding its own KV is no P
    fired = _stranded(
        prefill_1=IDLE_HOLDING | {"unpulled_handoffs": 0, "unpulled_ids": ()},
        decode_0={"up": False, "pulls_pending": None},
        decode_1=NOBODY_PULLS | {"num_running": 0.0, "num_waiting": 0.0, "kv_usage": 0.3},
    )
    assert list(fired) == ["prefill-1"]
    assert "no handoff it prefilled in the window went unserved" in fired["prefill-1"]


def test_the_alerts_section_sets_the_stranded_kv_floor() -> None:
    from pdscope.config import ConfigError, parse_config
    from tests.pdscope.test_config import MINIMAL

    ac = AlertConfig.from_settings(parse_config(MINIMAL + "alerts:\n  stranded_kv_usage: 0.2\n"))
    assert ac.stranded_kv_usage == 0.2
    assert (
        _stranded(prefill_0=IDLE_HOLDING)
        and not step_alerts(
            default_rules(ac), obs(0, prefill_0=IDLE_HOLDING, decode_0=NOBODY_PULLS), CFG, ac, {}
        ).changed
    )
    with pytest.raises(ConfigError, match="stranded_kv_usage"):
        parse_config(MINIMAL + "alerts:\n  stranded_kv_usage: 1.5\n")


# -- tenants -------------------------------------------------------------------------------


def _tenant(name: str, **kw: object) -> TenantFigures:
    return TenantFigures(name, 1.0, "interactive", 0.5, 0.1, **kw)  # type: ignore[arg-type]


def _tenant_alerts(*tenants: TenantFigures, min_requests: int = 10) -> dict[tuple[str, str], float]:
    window = TenantWindow(T0 - 300, T0, tenants, jain=None)
    ac = AlertConfig(for_s={"TenantSLOBreach": 0.0, "TenantStarved": 0.0}, min_requests=min_requests)
    step = step_alerts(default_rules(ac), replace(obs(0), tenants=window), CFG, ac, {})
    return {(a.rule, a.labels["tenant"]): a.value for a in step.active if a.rule.startswith("Tenant")}


def test_tenant_breach_needs_enough_served_requests_under_the_attainment_target() -> None:
    assert _tenant_alerts(_tenant("a", requests=20, demand=20, served=20, met=17)) == {
        ("TenantSLOBreach", "a"): 0.85
    }
    assert _tenant_alerts(_tenant("a", requests=20, demand=20, served=20, met=18)) == {}  # 0.9: on target
    assert _tenant_alerts(_tenant("a", requests=9, demand=9, served=9, met=0)) == {}  # too few to judge


def test_tenant_starved_needs_demand_and_no_service() -> None:
    refused = _tenant("b", requests=12, demand=12, rejected={"tenant_quota": 12})
    assert _tenant_alerts(refused) == {("TenantStarved", "b"): 12.0}
    assert _tenant_alerts(refused, min_requests=13) == {}
    served_once = _tenant("b", requests=12, demand=12, served=1, met=1, rejected={"tenant_quota": 11})
    assert _tenant_alerts(served_once) == {}
    # refused as the client's own mistake only: no demand on the fleet
    assert _tenant_alerts(_tenant("c", requests=12, demand=0)) == {}


def test_tenant_rules_stay_quiet_without_tenants() -> None:
    ac = AlertConfig(for_s={"TenantSLOBreach": 0.0, "TenantStarved": 0.0})
    step = step_alerts(default_rules(ac), obs(0), CFG, ac, {})
    assert not [a for a in step.active if a.rule.startswith("Tenant")]
