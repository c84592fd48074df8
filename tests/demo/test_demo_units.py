"""`pdscope demo` pieces that need no running stack (issue 13): the load generator's arguments
are ones `pdscope load` accepts, an earlier run's store is moved aside, a child that dies
(the load generator included) is reported, and the real-vLLM config for an attached pair."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdscope.cli import build_parser, demo
from pdscope.config import parse_config
from pdscope.stack import Child, ChildGroup
from simulator.workload import LengthDist


@pytest.mark.parametrize("real_vllm", [False, True])
def test_load_arguments_are_accepted_by_pdscope_load(real_vllm: bool, tmp_path: Path) -> None:
    argv = demo.load_argv(tmp_path / "pdscope.yaml", "http://127.0.0.1:8000", 1.0, 60.0, tmp_path, real_vllm)
    assert argv[:3] == [sys.executable, "-m", "pdscope.cli"]
    args = build_parser().parse_args(argv[3:])  # argparse: exits 2 on a bad flag
    assert args._module == "simulator.load" and args.url == "http://127.0.0.1:8000"
    # what `pdscope load` does with them before sending anything (it raises on a bad length)
    prompt, output = LengthDist.parse(args.prompt_len), LengthDist.parse(args.output_len)
    if real_vllm:
        assert (prompt.kind, prompt.a, prompt.b) == ("uniform", 16, 200)
        assert (output.kind, output.a) == ("fixed", 16)
    assert args.num_requests >= 60 and args.duration == 60.0 and args.no_progress


def _args(tmp_path: Path, **kw: object) -> argparse.Namespace:
    base = dict(
        real_vllm=False,
        workdir=str(tmp_path / "work"),
        rate=None,
        fault_after=-1.0,
        duration=5.0,
        no_dashboard=True,
        vllm_env=".vllm-cpu",
        prefill_url=None,
        decode_url=None,
        config=None,
    )
    base.update(kw)
    return argparse.Namespace(**base)


def test_fresh_workdir_moves_the_earlier_runs_store_aside(tmp_path: Path) -> None:
    work = tmp_path / "work"
    assert demo.fresh_workdir(work) is None  # a first run: nothing to move
    work.mkdir()
    (work / "pdscope.db").write_text("run 1")
    (work / "pdscope.db-wal").write_text("wal 1")
    (work / "logs").mkdir()
    (work / "logs" / "proxy.log").write_text("old log")
    (work / "pdscope.yaml").write_text("kept")
    previous = demo.fresh_workdir(work)
    assert previous == work / "previous"
    assert not (work / "pdscope.db").exists() and not (work / "pdscope.db-wal").exists()
    assert not (work / "logs").exists()
    assert (previous / "pdscope.db").read_text() == "run 1"
    assert (previous / "logs" / "proxy.log").read_text() == "old log"
    # a third run keeps only the run before it
    (work / "pdscope.db").write_text("run 2")
    demo.fresh_workdir(work)
    assert (previous / "pdscope.db").read_text() == "run 2" and not (previous / "logs").exists()


def test_dead_child_includes_a_failed_load_generator(tmp_path: Path) -> None:
    ok = Child("collector", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "c.log", env={})
    load = Child(
        "load",
        [sys.executable, "-c", "import sys; print('bad length distribution'); sys.exit(1)"],
        tmp_path / "load.log",
        env={},
    )
    stack = ChildGroup([ok, load])
    try:
        ok.start()
        load.start()
        assert load.proc is not None
        load.proc.wait(timeout=60)
        dead = demo._dead_child(stack, load_done=False)
        assert dead is load and dead.returncode() == 1 and "bad length distribution" in dead.tail()
        assert demo._dead_child(stack, load_done=True) is None  # a finished load is reported once
    finally:
        stack.stop()
    assert not ok.alive()


def test_demo_stops_loudly_when_the_load_generator_dies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No services, a load generator that exits 1 at once: the demo says so and exits 1
    (before issue 13 it kept printing "load: ... req/s" with nothing running)."""
    monkeypatch.setattr(demo, "_services", lambda *a, **k: [])
    monkeypatch.setattr(
        demo,
        "load_argv",
        lambda *a, **k: [
            sys.executable,
            "-c",
            "import sys; print('pdscope load: bad length distribution'); sys.exit(1)",
        ],
    )
    monkeypatch.setattr(demo, "_weights", lambda url: {})
    monkeypatch.setattr("store.migrate.upgrade", lambda url: None)
    code = demo.run(_args(tmp_path, duration=120.0))
    err = capsys.readouterr().err
    assert code == 1
    assert "load DIED (exit status 1)" in err and "bad length distribution" in err


def test_attached_real_vllm_config(tmp_path: Path) -> None:
    base = {
        "model": {"name": "x", "kv_bytes_per_token": 1},
        "pools": {},
        "proxy": {"port": 18000},
        "collector": {"port": 14318},
        "store": {"url": "sqlite:///elsewhere.db"},
    }
    cfg = demo.real_vllm_config(tmp_path, "http://127.0.0.1:1", "http://127.0.0.1:2", base)
    settings = parse_config(yaml.safe_dump(cfg))
    assert sorted((p, i.name, i.url) for p, i in settings.instances()) == [
        ("decode", "real-d0", "http://127.0.0.1:2"),
        ("prefill", "real-p0", "http://127.0.0.1:1"),
    ]
    assert settings.proxy.port == 18000 and settings.collector.port == 14318
    assert settings.store.url == f"sqlite:///{(tmp_path / 'pdscope.db').resolve()}"
    # the collector's spool beside the store, not in the machine's temp folder; one the config names kept
    assert settings.collector.spool_dir == str((tmp_path / "spool").resolve())
    base["collector"] = {"port": 14318, "spool_dir": "/var/spool/pd"}
    kept = parse_config(yaml.safe_dump(demo.real_vllm_config(tmp_path, "http://a:1", "http://b:2", base)))
    assert kept.collector.spool_dir == "/var/spool/pd"
    assert demo.demo_config({}, tmp_path)["collector"]["spool_dir"] == str((tmp_path / "spool").resolve())


def test_urls_without_real_vllm_are_a_usage_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdscope.cli",
            "demo",
            "--workdir",
            str(tmp_path),
            "--prefill-url",
            "http://127.0.0.1:1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--prefill-url and --decode-url go together" in proc.stderr


def test_the_demo_load_goes_out_as_the_declared_tenants(tmp_path: Path) -> None:
    """The example config has tenants on: the load is sent as each declared tenant in turn (not
    ``default``); without tenants, as none."""
    settings = parse_config(Path("examples/pdscope.yaml").read_text(), "examples/pdscope.yaml")
    tenants = demo.demo_tenants(settings)
    assert tenants == ["search", "reports"]
    argv = demo.load_argv(tmp_path / "p.yaml", "http://127.0.0.1:8000", 1.0, 60.0, tmp_path, False, tenants)
    assert build_parser().parse_args(argv[3:]).tenant == ["search", "reports"]
    off = settings.model_copy(update={"tenants": settings.tenants.model_copy(update={"enabled": False})})
    assert demo.demo_tenants(off) == []
