"""One vocabulary for alerts: a Prometheus rule on the same condition as a controller rule
has exactly the controller's name, and Alertmanager treats the two sources sensibly.

``TWINS`` is the decision, per controller rule, of which Prometheus rule alerts on the same
condition (found by the series its expression reads); ``NO_TWIN`` names the rules that have
none, with the reason. A new controller rule must be put in one of them. The inhibition tests
run the shipped ``alertmanager.yml``'s inhibit rules over label sets as each source sends them
(Alertmanager's semantics: every matcher must hold on its side, and every ``equal`` label must
have the same value on both, a missing label counting as empty).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.notify import alert_json
from controller.policy import AlertState
from pdscope.config import ALERT_RULE_NAMES

REPO = Path(__file__).resolve().parents[2]
PROM = REPO / "deploy" / "prometheus"
ALERTMANAGER = PROM / "alertmanager.yml"

# controller rule -> what identifies its Prometheus twin's expression (a regex on `expr`)
TWINS: dict[str, str] = {
    "TTFTOverTarget": r"pdscope:slo_ttft_seconds:target",
    "GoodputAttainmentLow": r"\bpdscope_slo_attainment\b",
    "NixlTransferFailures": r"instance:vllm_nixl_failed_transfers:ratio_rate5m",
    "KVLeaseExpired": r"vllm:nixl_num_kv_expired_reqs_total",
    "KVCacheNearlyFull": r"vllm:kv_cache_usage_perc",
    "InstanceDown": r'^up\{job="vllm"\} == 0$',
    "TenantSLOBreach": r"\bpdscope_tenant_slo_attainment\b",
    "TenantStarved": r"\bpdscope_proxy_tenant_admitted_total\b",
}
NO_TWIN: dict[str, str] = {
    "TPOTOverTarget": "ITLOverTarget reads vLLM's inter-token latency, a per-token gap, not TPOT",
    "HandoffP99OverBudget": "the handoff time exists only in pdscope's request records",
    "CollectorBehind": "ServiceDown and CollectorStoreErrors are causes, not the same condition",
    "TTFTMispredicted": "the TTFT predictions exist only in pdscope's request records",
    "StrandedKV": "which instances are P and which D exists only in pdscope's config",
    "IncompatiblePair": "the revisions exist only in pdscope's config; P and D only in its config too",
}
OLD_PREFIXES = re.compile(r"VLLM|NIXL|PDScope|Pdscope")


def _alerts() -> list[dict[str, Any]]:
    alerts: list[dict[str, Any]] = []
    for path in sorted((PROM / "rules").glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            alerts.extend(r for r in group["rules"] if "alert" in r)
    return alerts


def test_every_controller_rule_is_decided_once() -> None:
    assert not set(TWINS) & set(NO_TWIN)
    assert set(TWINS) | set(NO_TWIN) == set(ALERT_RULE_NAMES)


@pytest.mark.parametrize("rule", sorted(TWINS))
def test_a_prometheus_twin_has_exactly_the_controllers_name(rule: str) -> None:
    matching = [a["alert"] for a in _alerts() if re.search(TWINS[rule], a["expr"].strip())]
    assert matching == [rule], f"the Prometheus rule on {rule}'s condition is {matching}"


def test_no_prometheus_rule_borrows_a_controller_name_for_another_condition() -> None:
    for alert in _alerts():
        name = alert["alert"]
        if name in ALERT_RULE_NAMES:
            assert name in TWINS, f"{name}: the controller's rule has no twin here ({NO_TWIN.get(name)})"
            assert re.search(TWINS[name], alert["expr"].strip()), f"{name}: not the twin's condition"


def test_prometheus_alerts_say_their_source_and_share_one_naming_scheme() -> None:
    for alert in _alerts():
        name = alert["alert"]
        assert alert["labels"].get("source") == "prometheus", name
        # words and the acronyms the controller spells in capitals; "Nixl" as the controller writes it
        assert re.fullmatch(r"(?:[A-Z][a-z]+|TTFT|ITL|TPOT|KV|SLO)+", name), name
        assert "Kv" not in name, f"{name}: KV in capitals, as the controller writes it"
        assert not OLD_PREFIXES.search(name), f"{name}: product prefix or NIXL/VLLM spelling"


def test_alert_annotations_use_the_one_spelling() -> None:
    banned = re.compile(
        r"KV cache usage|KV utili[sz]ation|expired leases|leases expired|lease expirations", re.I
    )
    for alert in _alerts():
        for key in ("summary", "description"):
            text = alert["annotations"][key]
            assert not banned.search(text), (alert["alert"], key, text)
    for doc in (REPO / "docs" / "alerts.md", REPO / "docs" / "deploy.md", PROM / "RUNBOOK.md"):
        found = banned.findall(doc.read_text())
        assert not found, (doc.name, found)


# -- Alertmanager inhibitions over both sources ---------------------------------------------


def _matches(matcher: str, labels: dict[str, str]) -> bool:
    m = re.fullmatch(r'([a-z_]+)(=~|!~|!=|=)"([^"]*)"', matcher)
    assert m, f"matcher not understood: {matcher}"
    name, op, value = m.groups()
    have = labels.get(name, "")
    if op == "=":
        return have == value
    if op == "!=":
        return have != value
    hit = re.fullmatch(value, have) is not None
    return hit if op == "=~" else not hit


def _inhibited(target: dict[str, str], firing: list[dict[str, str]]) -> bool:
    rules = yaml.safe_load(ALERTMANAGER.read_text())["inhibit_rules"]
    for rule in rules:
        if not all(_matches(m, target) for m in rule["target_matchers"]):
            continue
        for source in firing:
            if source is target or not all(_matches(m, source) for m in rule["source_matchers"]):
                continue
            if all(source.get(x, "") == target.get(x, "") for x in rule.get("equal", [])):
                return True
    return False


def _controller(name: str, severity: str, **labels: str) -> dict[str, str]:
    """Labels as the controller's notifier sends them for a rule's alert."""
    state = AlertState(
        name, "f" * 16, labels, severity, "firing", 1.0, "d", "s", active_since=0.0, last_eval=0.0
    )
    sent: dict[str, str] = alert_json(state, "http://controller")["labels"]
    return sent


def _prometheus(name: str, severity: str, **labels: str) -> dict[str, str]:
    return {"alertname": name, "severity": severity, "source": "prometheus", **labels}


D1 = {"instance": "decode-1", "pool": "decode", "role": "decode"}
D0 = {"instance": "decode-0", "pool": "decode", "role": "decode"}


def test_a_controller_alert_inhibits_its_prometheus_twin_for_the_same_instance_only() -> None:
    ctl = _controller("InstanceDown", "critical", **D1)
    twin = _prometheus("InstanceDown", "critical", job="vllm", **D1)
    other = _prometheus("InstanceDown", "critical", job="vllm", **D0)
    firing = [ctl, twin, other]
    assert _inhibited(twin, firing)
    assert not _inhibited(other, firing)
    assert not _inhibited(ctl, firing)  # the controller's alert is never the one hidden
    assert not _inhibited(twin, [twin, other]), "the controller down: Prometheus's alert is the fallback"


def test_a_twin_that_pages_harder_is_not_hidden() -> None:
    ctl = _controller("NixlTransferFailures", "warning", **D1)
    twin = _prometheus("NixlTransferFailures", "critical", **D1)
    assert not _inhibited(twin, [ctl, twin])


def test_goodput_twins_inhibit_fleet_wide_despite_the_scrape_labels() -> None:
    ctl = _controller("GoodputAttainmentLow", "critical")
    twin = _prometheus(
        "GoodputAttainmentLow", "critical", job="pdscope-controller", instance="controller:8000"
    )
    assert _inhibited(twin, [ctl, twin])


def test_only_prometheus_instance_down_explains_the_collector_failing_to_scrape() -> None:
    target_down = _prometheus("CollectorTargetDown", "warning", job="pdscope-collector", **D1)
    assert _inhibited(target_down, [target_down, _prometheus("InstanceDown", "critical", job="vllm", **D1)])
    # the controller's InstanceDown is the collector's own scrape failing: it explains nothing
    assert not _inhibited(target_down, [target_down, _controller("InstanceDown", "critical", **D1)])


def test_a_pool_down_hides_instance_down_from_both_sources() -> None:
    pool = _prometheus("PoolDown", "critical", pool="decode", role="decode")
    ctl = _controller("InstanceDown", "critical", **D1)
    twin = _prometheus("InstanceDown", "critical", job="vllm", **D1)
    assert _inhibited(ctl, [pool, ctl, twin]) and _inhibited(twin, [pool, ctl, twin])


def test_fleet_wide_ttft_does_not_hide_the_per_pool_alert_that_says_where() -> None:
    ctl = _controller("TTFTOverTarget", "warning")
    per_pool = _prometheus("TTFTOverTarget", "warning", pool="decode", role="decode")
    assert not _inhibited(per_pool, [ctl, per_pool])


def test_grouping_puts_one_condition_from_both_sources_in_one_notification() -> None:
    group_by = yaml.safe_load(ALERTMANAGER.read_text())["route"]["group_by"]
    assert "alertname" in group_by and "source" not in group_by
    ctl = _controller("GoodputAttainmentLow", "critical")
    twin = _prometheus(
        "GoodputAttainmentLow", "critical", job="pdscope-controller", instance="controller:8000"
    )
    assert {k: ctl.get(k, "") for k in group_by} == {k: twin.get(k, "") for k in group_by}
