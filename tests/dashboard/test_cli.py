from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dashboard import cli
from devdata.seed import SeedSpec, fleet_config_yaml
from pdscope.cli import build_parser


def test_streamlit_command_runs_the_app_headless_with_the_config() -> None:
    cmd = cli.streamlit_command(Path("/etc/pdscope.yaml"), "127.0.0.1", 8599, python="/py")
    assert cmd[:5] == ["/py", "-m", "streamlit", "run", str(cli.APP)]
    assert cli.APP.name == "app.py" and cli.APP.is_file()
    opts = dict(zip(cmd[5:-3:2], cmd[6:-3:2], strict=True))
    assert opts["--server.address"] == "127.0.0.1"
    assert opts["--server.port"] == "8599"
    assert opts["--server.headless"] == "true"
    assert cmd[-3:] == ["--", "--config", "/etc/pdscope.yaml"]


def test_dashboard_subcommand_flags() -> None:
    args = build_parser().parse_args(
        ["--config", "x.yaml", "dashboard", "--port", "9000", "--host", "0.0.0.0"]
    )
    assert (args.port, args.host, args._module) == (9000, "0.0.0.0", "dashboard.cli")


def test_bad_config_fails_fast_without_starting_streamlit(tmp_path: Path) -> None:
    bad = tmp_path / "pdscope.yaml"
    bad.write_text("model: {name: m}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pdscope.cli", "--config", str(bad), "dashboard"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "pdscope.yaml" in proc.stderr and "kv_bytes_per_token" in proc.stderr


def test_config_path_from_argv_reads_only_our_flag() -> None:
    from dashboard.context import config_path_from_argv

    assert config_path_from_argv(["--config", "a.yaml"]) == "a.yaml"
    assert config_path_from_argv(["--config-file", "b", "-q"]) is None
    assert config_path_from_argv([]) is None


def test_seeded_config_is_valid(tmp_path: Path) -> None:
    from pdscope.config import parse_config

    settings = parse_config(
        fleet_config_yaml(SeedSpec(end=0.0), f"sqlite:///{tmp_path}/s.db", controller_port=9)
    )
    assert [i.name for _, i in settings.instances("decode")] == ["decode-0", "decode-1", "decode-2"]
    assert settings.controller_url == "http://127.0.0.1:9"
