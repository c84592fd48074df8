"""deploy/prometheus: promtool checks, promtool rule unit tests, and the rules' bookkeeping.

The promtool tests need Debian's ``prometheus`` package (``.ci/run`` installs it); without
promtool they skip loudly (the tier table prints ``SKIPPED TIER PROMTOOL``). The
bookkeeping tests (every alert annotated, linked to a runbook section and unit-tested both
firing and not firing) need nothing and run in the unit tier.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdscope.config import SLOSettings
from tests.captures import SCRAPE_PAGES

REPO = Path(__file__).resolve().parents[2]
PROM = REPO / "deploy" / "prometheus"
RULE_FILES = sorted((PROM / "rules").glob("*.yml"))
TEST_FILES = sorted((PROM / "tests").glob("*.yml"))
RUNBOOK = PROM / "RUNBOOK.md"


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(
            "promtool tier skipped: promtool is not installed (apt-get install prometheus; .ci/run does it)"
        )
    return path


def _run(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def _rules() -> Iterator[dict[str, Any]]:
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            yield from group["rules"]


def _alerts() -> list[dict[str, Any]]:
    return [r for r in _rules() if "alert" in r]


def _records() -> list[dict[str, Any]]:
    return [r for r in _rules() if "record" in r]


def _unit_tests() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    for path in TEST_FILES:
        cases.extend(yaml.safe_load(path.read_text())["tests"])
    return cases


def _github_anchor(heading: str) -> str:
    """GitHub's heading slug: lower case, punctuation dropped, spaces to dashes."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


# -- promtool ----------------------------------------------------------------------------


@pytest.mark.promtool
def test_promtool_check_config() -> None:
    out = _run(_promtool(), "check", "config", "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    # the config pulls in every rule file
    assert f"SUCCESS: {len(RULE_FILES)} rule files found" in out.stdout + out.stderr


@pytest.mark.promtool
def test_promtool_check_rules() -> None:
    out = _run(_promtool(), "check", "rules", *[str(p) for p in RULE_FILES])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAILED" not in out.stdout + out.stderr


@pytest.mark.promtool
def test_promtool_rule_unit_tests_pass() -> None:
    assert TEST_FILES, "no promtool unit tests in deploy/prometheus/tests/"
    out = _run(_promtool(), "test", "rules", *[str(p) for p in TEST_FILES])
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == len(TEST_FILES), out.stdout


@pytest.mark.canary
@pytest.mark.promtool
def test_promtool_rule_unit_tests_catch_a_wrong_expectation(tmp_path: Path) -> None:
    """The unit tests compare exact labels, annotations and values: a wrong one fails them."""
    promtool = _promtool()
    source = PROM / "tests" / "vllm-rules_test.yml"
    broken = source.read_text().replace("value: 4.975", "value: 4.5", 1)
    assert broken != source.read_text()
    (tmp_path / "tests").mkdir()
    shutil.copytree(PROM / "rules", tmp_path / "rules")
    (tmp_path / "tests" / source.name).write_text(broken)
    out = _run(promtool, "test", "rules", str(tmp_path / "tests" / source.name), cwd=tmp_path)
    assert out.returncode != 0
    assert "4.975" in out.stdout + out.stderr


# -- bookkeeping (no promtool needed) ----------------------------------------------------


def test_every_alert_is_annotated_and_has_a_runbook_section() -> None:
    alerts = _alerts()
    assert len(alerts) >= 12
    runbook = RUNBOOK.read_text()
    headings = {_github_anchor(m.group(1)): m.start() for m in re.finditer(r"^#{2,4} (.+)$", runbook, re.M)}
    for alert in alerts:
        name = alert["alert"]
        ann = alert.get("annotations", {})
        assert ann.get("summary"), f"{name}: no summary"
        assert ann.get("description"), f"{name}: no description"
        assert alert.get("labels", {}).get("severity") in {"critical", "warning", "info"}, name
        url = ann.get("runbook_url", "")
        assert url == f"deploy/prometheus/RUNBOOK.md#{name.lower()}", f"{name}: runbook_url {url!r}"
        anchor = url.split("#", 1)[1]
        assert anchor in headings, f"{name}: RUNBOOK.md has no section #{anchor}"
        # the section has a real paragraph, not just a heading
        start = headings[anchor]
        following = runbook[start:].split("\n", 1)[1]
        body = re.split(r"^#{2,4} ", following, maxsplit=1, flags=re.M)[0]
        assert len(body.split()) >= 40, f"{name}: runbook section is too thin"


def test_alert_names_are_unique() -> None:
    names = [a["alert"] for a in _alerts()]
    assert len(names) == len(set(names))


def test_every_alert_has_a_firing_and_a_not_firing_unit_test() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in _unit_tests():
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    for alert in _alerts():
        name = alert["alert"]
        assert name in firing, f"{name}: no unit test where it fires"
        assert name in quiet, f"{name}: no unit test where it does not fire"


def test_every_recording_rule_has_a_unit_test() -> None:
    tested: set[str] = set()
    for case in _unit_tests():
        for check in case.get("promql_expr_test", []):
            tested.update(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", check["expr"]))
    for record in _records():
        assert record["record"] in tested, f"{record['record']}: no promql_expr_test"


def test_every_rule_file_is_covered_by_the_unit_tests() -> None:
    loaded: set[str] = set()
    for path in TEST_FILES:
        for rel in yaml.safe_load(path.read_text())["rule_files"]:
            loaded.add((path.parent / rel).resolve().name)
    assert {p.name for p in RULE_FILES} <= loaded


def test_slo_targets_match_pdscope_defaults() -> None:
    """rules/slo-targets.yml must say what pdscope.yaml's slo.* defaults say."""
    defaults = SLOSettings()
    records = {r["record"]: r["expr"] for r in _records()}
    expect = {
        "pdscope:slo_ttft_seconds:target": defaults.ttft.target_ms / 1000,
        "pdscope:slo_tpot_seconds:target": defaults.tpot.target_ms / 1000,
        "pdscope:slo_goodput_attainment:target": defaults.goodput_attainment,
    }
    for name, value in expect.items():
        match = re.fullmatch(r"vector\(([0-9.]+)\)", records[name].strip())
        assert match, f"{name}: {records[name]!r} is not vector(<number>)"
        assert float(match.group(1)) == pytest.approx(value), name
    # the recorded percentiles are the ones the SLOs are defined on
    assert defaults.ttft.percentile == defaults.tpot.percentile == 99.0
    for name, expr in records.items():
        if ":p99_" in name:
            assert "histogram_quantile(0.99," in expr, name


def test_rules_use_only_vllm_metric_names_from_the_real_capture() -> None:
    """Every vllm:* series a rule reads exists on a real vLLM P or D /metrics page."""
    pages = [SCRAPE_PAGES / "prefill_metrics.txt", SCRAPE_PAGES / "decode_metrics.txt"]
    exposed = set()
    for page in pages:
        for line in page.read_text().splitlines():
            if line and not line.startswith("#"):
                exposed.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    used = set()
    for rule in _rules():
        used.update(re.findall(r"\bvllm:[a-z_]+", rule["expr"]))
    assert used, "no vllm:* series in the rules"
    missing = sorted(used - exposed)
    assert not missing, f"rules read series that real vLLM does not expose: {missing}"


def _pdscope_series_defined_in_code() -> set[str]:
    """Every pdscope_* family the proxy, collector and controller define, as exposed series."""
    names: set[str] = set()
    for package in ("proxy", "collector", "controller"):
        for path in (REPO / package).rglob("*.py"):
            names.update(re.findall(r"[\"'](pdscope_[a-z_]+)[\"']", path.read_text()))
    exposed = set()
    for name in names:
        exposed.update({name, f"{name}_total", f"{name}_bucket", f"{name}_sum", f"{name}_count"})
    return exposed


def test_rules_and_dashboard_read_only_pdscope_series_the_services_expose() -> None:
    defined = _pdscope_series_defined_in_code()
    if not defined:
        pytest.skip("pdscope's services define no metrics yet")
    texts = [rule["expr"] for rule in _rules()]
    dashboard = REPO / "deploy" / "grafana" / "pdscope-dashboard.json"
    texts.append(dashboard.read_text())
    used = set()
    for text in texts:
        used.update(re.findall(r"\bpdscope_[a-z_]+", text))
    used.discard("pdscope_io_role")  # Kubernetes label names, not series
    assert used, "no pdscope_* series in the rules or the dashboard"
    missing = sorted(used - defined)
    assert not missing, f"rules/dashboard read pdscope series no service exposes: {missing}"


# -- Alertmanager ------------------------------------------------------------------------

ALERTMANAGER = PROM / "alertmanager.yml"


def _matcher_names(matchers: list[str]) -> set[str]:
    """Alert names a list of matchers selects: alertname="X" or alertname=~"X|Y"."""
    names: set[str] = set()
    for m in matchers:
        found = re.fullmatch(r'alertname(=~?)"([^"]+)"', m)
        if found:
            names.update(found.group(2).split("|") if found.group(1) == "=~" else [found.group(2)])
    return names


def _alert_labels(alert: dict[str, Any]) -> set[str]:
    """Labels an alert carries: alertname, its rule labels, plus the `by (...)` of an aggregated
    expression, or the target labels every scraped series has (job, instance, pool, role)."""
    labels = {"alertname", *alert.get("labels", {})}
    groupings = re.findall(r"\bby \(([^)]*)\)", alert["expr"])
    if groupings:
        for grouping in groupings:
            labels.update(x.strip() for x in grouping.split(","))
    else:
        labels.update({"job", "instance", "pool", "role"})
    return labels


def test_alertmanager_inhibitions_name_real_alerts_and_labels() -> None:
    config = yaml.safe_load(ALERTMANAGER.read_text())
    alerts = {a["alert"]: a for a in _alerts()}
    receivers = {r["name"] for r in config["receivers"]}
    assert config["route"]["receiver"] in receivers
    for route in config["route"].get("routes", []):
        assert route["receiver"] in receivers
    assert {"alertname", "pool"} <= set(config["route"]["group_by"])
    assert config["inhibit_rules"]
    for rule in config["inhibit_rules"]:
        sources = _matcher_names(rule["source_matchers"])
        targets = _matcher_names(rule["target_matchers"])
        assert sources and targets, rule
        assert sources | targets <= set(alerts), f"unknown alert in {rule}"
        # labels the inhibition compares are on both sides' alerts
        for label in rule.get("equal", []):
            for name in sources | targets:
                assert label in _alert_labels(alerts[name]), (name, label)


@pytest.mark.promtool
def test_amtool_check_config() -> None:
    amtool = shutil.which("amtool")
    if amtool is None:
        pytest.skip(
            "promtool tier skipped: amtool is not installed "
            "(apt-get install prometheus-alertmanager; .ci/run does it)"
        )
    out = _run(amtool, "check-config", str(ALERTMANAGER))
    assert out.returncode == 0, out.stdout + out.stderr
    n = len(yaml.safe_load(ALERTMANAGER.read_text())["inhibit_rules"])
    assert f"{n} inhibit rules" in out.stdout
