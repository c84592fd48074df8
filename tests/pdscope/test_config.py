from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from pdscope.config import ConfigError, load_config, parse_config, resolve_config_path

REPO = Path(__file__).resolve().parents[2]

MINIMAL = """
model: {name: tiny, kv_bytes_per_token: 1024}
pools:
  p: {role: prefill, instances: [{name: p0, url: "http://127.0.0.1:8100"}]}
  d: {role: decode, instances: [{name: d0, url: "http://127.0.0.1:8200/"}]}
"""


@pytest.mark.parametrize("name", ["pdscope.yaml", "real-gpu.yaml"])
def test_shipped_examples_are_valid(name: str) -> None:
    settings = load_config(REPO / "examples" / name)
    assert {p.role for p in settings.pools.values()} == {"prefill", "decode"}


def test_minimal_file_gets_defaults() -> None:
    s = parse_config(MINIMAL)
    assert s.store.url == "sqlite:///pdscope.db"
    assert s.controller.mode == "enforce"
    d0 = dict((i.name, i) for _, i in s.instances("decode"))["d0"]
    assert d0.url == "http://127.0.0.1:8200"  # trailing slash removed
    assert d0.scrape_url == "http://127.0.0.1:8200/metrics"
    assert s.pool_of("p0") == "p"
    assert s.controller_url == "http://127.0.0.1:8300"


@pytest.mark.canary
def test_settings_are_frozen() -> None:
    s = parse_config(MINIMAL)
    with pytest.raises(ValidationError):
        s.controller.port = 1  # type: ignore[misc]


def test_wrong_type_missing_pool_unknown_key_give_three_lines() -> None:
    text = """model: {name: tiny, kv_bytes_per_token: 1024}
pools:
  prefill:
    role: prefill
    instances: [{name: p0, url: "http://127.0.0.1:8100"}]
controller:
  interval_s: fast
colector:
  port: 1
"""
    with pytest.raises(ConfigError) as exc:
        parse_config(text, "bad.yaml")
    lines = exc.value.problems
    assert len(lines) == 3, lines
    assert any(ln.startswith("bad.yaml:7: controller.interval_s:") and "'fast'" in ln for ln in lines)
    assert any(ln.startswith("bad.yaml:2: pools:") and "no decode pool" in ln for ln in lines)
    assert any(ln.startswith("bad.yaml:8: colector:") and "unknown key" in ln for ln in lines)


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        (
            "model: {name: x, kv_bytes_per_token: 1}\nmodel: {name: y, kv_bytes_per_token: 1}\n",
            "duplicate key 'model'",
        ),
        ("model: [unclosed\n", "not valid YAML"),
        ("- a\n- b\n", "top level must be a mapping"),
        (
            MINIMAL + "collector: {scrape_interval_s: 2, scrape_timeout_s: 5}\n",
            "shorter than scrape_interval_s",
        ),
        (MINIMAL.replace("http://127.0.0.1:8100", "127.0.0.1:8100"), "pools.p.instances.0.url"),
        (MINIMAL.replace("name: d0", "name: p0"), "must be unique"),
        (MINIMAL.replace("kv_bytes_per_token: 1024", "kv_bytes_per_token: -1"), "model.kv_bytes_per_token"),
        (MINIMAL + "controller: {mode: yolo}\n", "controller.mode"),
        (MINIMAL + "tenants: {cost_per_kv_token_step: -0.5}\n", "tenants.cost_per_kv_token_step"),
        (MINIMAL + "tenants: {cost_per_kv_token_step: 2}\n", "tenants.cost_per_kv_token_step"),
    ],
)
def test_invalid_files_name_the_problem(snippet: str, expected: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(snippet, "f.yaml")
    assert any(expected in line for line in exc.value.problems), exc.value.problems
    assert all(line.startswith("f.yaml") for line in exc.value.problems)


def test_scheduling_is_the_pools_unless_an_instance_says_otherwise() -> None:
    assert parse_config(MINIMAL).priority_scheduled() == frozenset()
    d1 = '{name: d1, url: "http://127.0.0.1:8201", scheduling: priority}'
    text = MINIMAL.replace("role: prefill,", "role: prefill, scheduling: priority,").replace(
        'url: "http://127.0.0.1:8200/"}', f'url: "http://127.0.0.1:8200/"}}, {d1}'
    )
    s = parse_config(text)
    assert s.pools["p"].scheduling == "priority" and s.pools["d"].scheduling == "fcfs"
    assert s.priority_scheduled() == frozenset({"p0", "d1"})
    for bad in ("scheduling: lottery", "scheduling: 1"):
        with pytest.raises(ConfigError) as exc:
            parse_config(MINIMAL.replace("role: decode,", f"role: decode, {bad},"), "f.yaml")
        assert any("pools.d.scheduling" in line for line in exc.value.problems), exc.value.problems


def test_unreadable_and_non_utf8_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"model: {name: caf\xe9}\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(bad)


def test_api_token_comes_from_the_named_variable() -> None:
    s = parse_config(MINIMAL + "controller: {api_token_env: MY_TOKEN}\n")
    assert s.api_token({"MY_TOKEN": "s3cret"}) == "s3cret"
    assert s.api_token({}) is None
    assert s.api_token({"MY_TOKEN": ""}) is None


def test_config_path_resolution() -> None:
    assert resolve_config_path("a.yaml", {"PDSCOPE_CONFIG": "b.yaml"}) == Path("a.yaml")
    assert resolve_config_path(None, {"PDSCOPE_CONFIG": "b.yaml"}) == Path("b.yaml")
    assert resolve_config_path(None, {}) == Path("pdscope.yaml")
