"""The ``pdscope`` command line: its subcommands, the config check and the db commands."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from pdscope import cli
from pdscope.cli import COMMANDS
from pdscope.config import ConfigError, load_settings

REPO = Path(__file__).resolve().parents[2]


def pdscope(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdscope.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_help_lists_every_subcommand() -> None:
    out = pdscope("--help")
    assert out.returncode == 0
    for name in ("demo", "sim", "load", "proxy", "collect", "control", "dashboard", "db", "config"):
        assert name in COMMANDS
        assert f"    {name} " in out.stdout, name


def test_config_check_ok_and_failing(tmp_path: Path) -> None:
    ok = pdscope("config", "check", "examples/pdscope.yaml")
    assert ok.returncode == 0, ok.stderr
    assert "ok" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "model: {name: t, kv_bytes_per_token: 1}\n"
        "pools: {p: {role: prefill, instances: [{name: p0, url: 'http://h'}]}}\n"
        "controller: {interval_s: fast}\n"
        "colector: {}\n"
    )
    out = pdscope("config", "check", str(bad))
    assert out.returncode == 1
    problems = [
        ln for ln in out.stderr.splitlines() if ln.startswith(str(bad) + ":") and "problem(s)" not in ln
    ]
    assert len(problems) == 3, out.stderr


def test_config_check_names_a_shadow_setting_that_is_not_one(tmp_path: Path) -> None:
    text = (REPO / "examples" / "pdscope.yaml").read_text()
    bad = tmp_path / "shadow.yaml"
    bad.write_text(
        text.replace("controller:\n", "controller:\n  shadow: {min_wieght: 0.1, recover_ticks: 2}\n", 1)
    )
    out = pdscope("config", "check", str(bad))
    assert out.returncode == 1
    assert f"{bad}: controller.shadow.min_wieght: not a policy setting (did you mean min_weight" in out.stderr
    good = tmp_path / "good.yaml"
    good.write_text(text.replace("controller:\n", "controller:\n  shadow: {min_weight: 0.1}\n", 1))
    assert pdscope("config", "check", str(good)).returncode == 0


def test_db_upgrade_and_check_through_the_cli(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    up = pdscope("--config", "examples/pdscope.yaml", "db", "--url", url, "upgrade")
    assert up.returncode == 0, up.stderr
    chk = pdscope("--config", "examples/pdscope.yaml", "db", "--url", url, "check")
    assert chk.returncode == 0, chk.stderr
    bad = pdscope("db", "--url", "nosuchdriver://x", "upgrade")
    assert bad.returncode == 1
    assert "invalid store URL" in bad.stderr or "pdscope db upgrade" in bad.stderr


def test_the_console_script_is_the_cli_main() -> None:
    (script,) = entry_points(group="console_scripts", name="pdscope")
    assert script.load() is cli.main


def test_every_subcommand_module_has_a_run() -> None:
    for name, (module, _summary, _description) in COMMANDS.items():
        assert callable(getattr(importlib.import_module(module), "run", None)), name


def test_load_settings_reads_the_file_config_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSCOPE_CONFIG", raising=False)
    settings = load_settings(argparse.Namespace(config=str(REPO / "examples" / "pdscope.yaml")))
    assert [inst.name for _, inst in settings.instances("prefill")]
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {name: t, kv_bytes_per_token: 1}\ncolector: {}\n")
    with pytest.raises(ConfigError) as err:
        load_settings(argparse.Namespace(config=str(bad)))
    assert any(line.startswith(str(bad) + ":") for line in err.value.problems), err.value.problems
