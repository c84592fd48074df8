"""The ``alerts`` section and ``slo.handoff_budget_ms``: defaults, overrides, and one clear line per
mistake."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdscope.config import ALERT_RULE_NAMES, ConfigError, parse_config
from tests.pdscope.test_config import MINIMAL

REPO = Path(__file__).resolve().parents[2]

OVERRIDES = (
    MINIMAL
    + """slo:
  ttft: {target_ms: 3000}
  handoff_budget_ms: 750
alerts:
  resend_s: 30
  min_requests: 5
  kv_full: 0.9
  rules:
    KVLeaseExpired: {for_s: 0}
    TTFTOverTarget: {for_s: 120, severity: critical}
    HandoffP99OverBudget: {enabled: false}
"""
)


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_config(text, "f.yaml")
    return exc.value.problems


def test_no_alerts_section_gets_defaults() -> None:
    s = parse_config(MINIMAL)
    assert (s.alerts.resend_s, s.alerts.min_requests, s.alerts.kv_full) == (60.0, 10, 0.95)
    assert s.alerts.rules == {}
    assert s.slo.handoff_budget_ms is None


def test_overrides_are_read() -> None:
    s = parse_config(OVERRIDES)
    a = s.alerts
    assert (a.resend_s, a.min_requests, a.kv_full) == (30.0, 5, 0.9)
    assert set(a.rules) == {"KVLeaseExpired", "TTFTOverTarget", "HandoffP99OverBudget"}
    assert a.rules["TTFTOverTarget"].for_s == 120.0 and a.rules["TTFTOverTarget"].severity == "critical"
    assert a.rules["TTFTOverTarget"].enabled is True
    assert a.rules["KVLeaseExpired"].for_s == 0.0 and a.rules["KVLeaseExpired"].severity is None
    assert a.rules["HandoffP99OverBudget"].enabled is False and a.rules["HandoffP99OverBudget"].for_s is None
    assert s.slo.handoff_budget_ms == 750.0 and s.slo.ttft.target_ms == 3000.0


def test_unknown_rule_is_one_line_at_its_own_line_listing_the_known_names() -> None:
    text = MINIMAL + "alerts:\n  rules:\n    TTFTOverTarget: {for_s: 10}\n    TTFTOverTraget: {for_s: 10}\n"
    lines = problems(text)
    assert len(lines) == 1, lines
    line_no = MINIMAL.count("\n") + 4  # the misspelt key's own line, not `rules:`
    assert lines[0].startswith(f"f.yaml:{line_no}: alerts.rules.TTFTOverTraget: unknown alert rule"), lines
    assert all(name in lines[0] for name in ALERT_RULE_NAMES)
    assert "[key]" not in lines[0]


@pytest.mark.parametrize(
    ("rules", "field", "reason"),
    [
        (
            "InstanceDown: {severity: page}",
            "alerts.rules.InstanceDown.severity",
            "'info', 'warning' or 'critical'",
        ),
        ("InstanceDown: {for_s: -1}", "alerts.rules.InstanceDown.for_s", "greater than or equal to 0"),
        ("InstanceDown: {enabled: maybe}", "alerts.rules.InstanceDown.enabled", "valid boolean"),
        ("InstanceDown: {for: 10}", "alerts.rules.InstanceDown.for", "unknown key"),
    ],
)
def test_bad_rule_fields_name_the_field_and_line(rules: str, field: str, reason: str) -> None:
    lines = problems(MINIMAL + "alerts:\n  rules:\n    " + rules + "\n")
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"f.yaml:{MINIMAL.count(chr(10)) + 3}: {field}: "), lines
    assert reason in lines[0], lines


@pytest.mark.parametrize(
    ("snippet", "field"),
    [
        ("alerts: {kv_full: 1.5}\n", "alerts.kv_full"),
        ("alerts: {min_requests: 0}\n", "alerts.min_requests"),
        ("alerts: {resend_s: 0}\n", "alerts.resend_s"),
        ("alerts: {rules: [TTFTOverTarget]}\n", "alerts.rules"),
        ("slo: {handoff_budget_ms: 0}\n", "slo.handoff_budget_ms"),
    ],
)
def test_bad_alert_settings(snippet: str, field: str) -> None:
    lines = problems(MINIMAL + snippet)
    assert len(lines) == 1 and f": {field}: " in lines[0], lines


def test_the_commented_example_in_examples_is_valid() -> None:
    """The commented ``alerts`` block in examples/pdscope.yaml, uncommented, must validate."""
    text = (REPO / "examples" / "pdscope.yaml").read_text()
    block = re.search(r"# BEGIN alerts example\n(.*?)# END alerts example", text, re.S)
    assert block is not None
    yaml_text = "\n".join(line.removeprefix("# ") for line in block.group(1).splitlines())
    s = parse_config(MINIMAL + yaml_text)
    assert s.alerts.rules["TTFTOverTarget"].severity == "critical"
    assert s.alerts.rules["HandoffP99OverBudget"].enabled is False
