"""`config check` gaps from issue 13: non-finite numbers, the duplicate-instance message,
unsupported store URLs, and a bounded parse (file size, YAML alias expansion, nesting).
What already held (file, line and field in every message) is asserted alongside."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdscope import config as cfg
from pdscope.config import ConfigError, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]

MINIMAL = """model: {name: tiny, kv_bytes_per_token: 1024}
pools:
  p:
    role: prefill
    instances: [{name: p0, url: "http://127.0.0.1:8100"}]
  d:
    role: decode
    instances:
      - {name: d0, url: "http://127.0.0.1:8200"}
"""


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_config(text, "f.yaml")
    return exc.value.problems


@pytest.mark.parametrize("bad", [".inf", "-.inf", ".nan", ".NaN", "'inf'", "'nan'", "1e400", "'-Infinity'"])
@pytest.mark.parametrize(
    ("section", "field"),
    [
        ("controller", "interval_s"),
        ("controller", "max_weight_step"),
        ("collector", "scrape_interval_s"),
        ("proxy", "routing_poll_s"),
        ("slo", "window_s"),
        ("store", "retention_raw_s"),
        ("alerts", "resend_s"),
    ],
)
def test_every_float_must_be_finite(section: str, field: str, bad: str) -> None:
    lines = problems(MINIMAL + f"{section}:\n  {field}: {bad}\n")
    assert any(ln.startswith(f"f.yaml:11: {section}.{field}:") and "finite" in ln for ln in lines), lines


def test_non_finite_pool_weight_and_slo_target_are_refused() -> None:
    text = MINIMAL.replace("    role: decode\n", "    role: decode\n    weight: .inf\n")
    assert any(ln.startswith("f.yaml:8: pools.d.weight:") and "finite" in ln for ln in problems(text))
    lines = problems(MINIMAL + "slo:\n  ttft: {target_ms: .inf}\n")
    assert any(ln.startswith("f.yaml:11: slo.ttft.target_ms:") and "finite" in ln for ln in lines), lines


def test_finite_rule_has_one_home_in_the_base_model() -> None:
    # Every section inherits it: a new float field cannot forget it.
    for model in (
        cfg.Settings,
        cfg.ControllerSettings,
        cfg.ProxySettings,
        cfg.CollectorSettings,
        cfg.SLOSettings,
        cfg.Pool,
        cfg.StoreSettings,
        cfg.AlertRuleSettings,
    ):
        assert model.model_config.get("allow_inf_nan") is False, model


def test_duplicate_instance_names_the_duplicate_both_pools_and_lines() -> None:
    text = MINIMAL + '      - {name: p0, url: "http://127.0.0.1:8201"}\n'
    lines = problems(text)
    assert lines == [
        "f.yaml:10: pools.d.instances.1.name: duplicate instance name 'p0' in pool 'd': also in pool 'p', "
        "at pools.p.instances.0 (line 5); instance names must be unique"
    ], lines


def test_duplicate_instance_within_one_pool() -> None:
    text = MINIMAL + '      - {name: d0, url: "http://127.0.0.1:8201"}\n'
    lines = problems(text)
    assert len(lines) == 1 and lines[0].startswith(
        "f.yaml:10: pools.d.instances.1.name: duplicate instance "
        "name 'd0' in pool 'd': also at pools.d.instances.0 (line 9)"
    )


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("notadb://x", "unsupported database 'notadb'"),
        ("mysql://u@h/db", "unsupported database 'mysql'"),
        ("garbage", "not a database URL"),
        ("", "not a database URL"),
        ("postgresql+psycopg2://u@h/db", "unsupported database 'postgresql+psycopg2'"),
    ],
)
def test_store_url_must_be_a_supported_database(url: str, why: str) -> None:
    lines = problems(MINIMAL + f"store:\n  url: '{url}'\n")
    assert any(ln.startswith("f.yaml:11: store.url:") and why in ln for ln in lines), lines


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:///pdscope.db",
        "sqlite:////var/lib/pdscope/p.db",
        "sqlite://",
        "postgresql://pdscope@db:5432/pdscope",
        "postgresql+psycopg://u:p@h/db",
        "postgres://u@h/db",
    ],
)
def test_supported_store_urls_pass(url: str) -> None:
    assert parse_config(MINIMAL + f"store:\n  url: '{url}'\n").store.url == url


def _billion_laughs(levels: int = 9) -> str:
    lines = ["lol0: &lol0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        refs = ", ".join([f"*lol{i - 1}"] * 10)
        lines.append(f"lol{i}: &lol{i} [{refs}]")
    return "\n".join(lines) + "\n"


def test_yaml_alias_bomb_is_refused_before_it_is_built() -> None:
    bomb = _billion_laughs()  # 10**9 values from under 1 KB; PyYAML alone would build all of them
    assert len(bomb) < 1000
    lines = problems(bomb)
    assert lines == [
        f"f.yaml: more than {cfg.MAX_CONFIG_VALUES} values once YAML aliases (*name) are expanded; "
        "refusing to read it (an alias bomb?)"
    ], lines


def test_recursive_alias_is_refused() -> None:
    assert "alias bomb" in problems("a: &a [*a, *a]\n")[0]


def test_modest_aliases_still_work() -> None:
    text = MINIMAL.replace(
        '[{name: p0, url: "http://127.0.0.1:8100"}]',
        '[{name: p0, url: "http://127.0.0.1:8100", labels: &hw {hw: h100, rack: r1}}]',
    )
    text += '      - {name: d1, url: "http://127.0.0.1:8201", labels: *hw}\n'
    s = parse_config(text)
    assert [(i.name, i.labels) for _, i in s.instances("decode")][1] == ("d1", {"hw": "h100", "rack": "r1"})


def test_deep_nesting_is_a_config_error_not_a_crash() -> None:
    lines = problems("a: " + "[" * 5000 + "]" * 5000 + "\n")
    assert lines == ["f.yaml: not valid YAML: nested too deeply"]


def test_oversized_config_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    with big.open("w") as f:
        f.write(MINIMAL + "simulator:\n  pad: '")
        f.write("x" * (cfg.MAX_CONFIG_BYTES + 10))
        f.write("'\n")
    with pytest.raises(ConfigError) as exc:
        load_config(big)
    assert exc.value.problems == [
        f"{big}: larger than {cfg.MAX_CONFIG_BYTES} bytes; a config may be at most that"
    ]
    assert "at most" in problems("a: '" + "x" * cfg.MAX_CONFIG_BYTES + "'\n")[0]


def test_config_check_cli_reports_the_bomb_and_exits_1(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(_billion_laughs())
    proc = subprocess.run(
        [sys.executable, "-m", "pdscope.cli", "config", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 1
    assert f"{path}: more than" in proc.stderr and "1 problem(s)" in proc.stderr


def test_held_every_problem_names_file_line_and_field() -> None:
    """What held before issue 13 and must keep holding: one line per problem, file:line: field: reason."""
    text = MINIMAL + "controller:\n  interval_s: fast\n  mode: yolo\ncolector: {port: 1}\n"
    lines = problems(text)
    assert sorted(lines) == sorted(
        [
            "f.yaml:11: controller.interval_s: Input should be a valid number, "
            "unable to parse string as a number (got 'fast')",
            "f.yaml:12: controller.mode: Input should be 'advisory' or 'enforce' (got 'yolo')",
            "f.yaml:13: colector: unknown key (not a pdscope setting; check its spelling and indentation)",
        ]
    ), lines


def test_the_simulator_section_is_checked_with_the_rest_of_the_file() -> None:
    """``simulator:`` is part of Settings: ``pdscope config check`` names its bad fields like any other."""
    lines = problems(MINIMAL + "simulator:\n  latency_scale: -1\n  kv_capacity_blok: 10\n")
    assert any(line.startswith("f.yaml:11: simulator.latency_scale:") for line in lines), lines
    assert any(line.startswith("f.yaml:12: simulator.kv_capacity_blok: unknown key") for line in lines), lines
    lines = problems(MINIMAL + "simulator:\n  instances: {d0: {seed: 3}}\n")
    assert any(
        "simulator" in line and "instances.d0: seed cannot be set per instance" in line for line in lines
    ), lines
    ok = parse_config(MINIMAL + "simulator: {latency_scale: 0, admin_port: 0}\n", "f.yaml")
    assert ok.simulator.latency_scale == 0.0 and ok.simulator.admin_port == 0
