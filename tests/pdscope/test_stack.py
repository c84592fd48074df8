"""The local-stack launcher (pdscope/stack.py): ports, config files, a child's start, readiness
probe and stop, and a group's ordered teardown, on real child processes."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import yaml

from pdscope.stack import (
    Child,
    ChildGroup,
    StartError,
    free_ports,
    loopback_url,
    pdscope_argv,
    succeeded,
    write_config,
)
from tests.support.waiting import wait_until

# A child that notes its SIGTERM in a shared file (or ignores it), then says it is ready.
TERM_NOTER = """
import signal, sys, time
name, notes, ignore = sys.argv[1], sys.argv[2], sys.argv[3] == "ignore"
def on_term(*_):
    if ignore:
        return
    with open(notes, "a") as f:
        f.write(name + "\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def _noter(tmp_path: Path, name: str, ignore: bool = False) -> Child:
    argv = [sys.executable, "-c", TERM_NOTER, name, str(tmp_path / "notes"), "ignore" if ignore else "-"]
    return Child(name, argv, tmp_path / f"{name}.log")


def _wait_started(child: Child) -> None:
    wait_until(f"{child.name} to install its handler", lambda: "ready" in child.log(), timeout_s=30)


def _http_server(tmp_path: Path, port: int) -> Child:
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    return Child("http", argv, tmp_path / "http.log", ready_url=loopback_url(port) + "/", cwd=tmp_path)


def test_free_ports_are_distinct() -> None:
    ports = free_ports(20)
    assert len(set(ports)) == 20 and all(0 < p < 65536 for p in ports)


def test_write_config_keeps_the_order(tmp_path: Path) -> None:
    cfg = {"model": {"name": "m"}, "pools": {}, "store": {"url": "sqlite:///x.db"}}
    path = write_config(tmp_path / "pdscope.yaml", cfg)
    assert yaml.safe_load(path.read_text()) == cfg
    assert list(yaml.safe_load(path.read_text())) == ["model", "pools", "store"]


def test_pdscope_argv() -> None:
    argv = pdscope_argv(Path("/c.yaml"), "sim", "--admin-port", "1", log_level="WARNING")
    head = [sys.executable, "-m", "pdscope.cli", "--config", "/c.yaml"]
    assert argv == [*head, "--log-level", "WARNING", "sim", "--admin-port", "1"]
    assert "--log-level" not in pdscope_argv(Path("/c.yaml"), "proxy")


def test_a_child_is_ready_when_its_url_answers_and_stops_on_term(tmp_path: Path) -> None:
    [port] = free_ports(1)
    with ChildGroup() as group:
        child = _http_server(tmp_path, port)
        assert group.start(child, 30.0, ready=succeeded)
        assert child.alive() and group["http"] is child
    assert not child.alive() and child.returncode() is not None


def test_a_child_that_exits_during_start_up_says_so_with_its_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)"]
    child = Child("sim", argv, tmp_path / "sim.log", ready_url=loopback_url(free_ports(1)[0]))
    with ChildGroup() as group, pytest.raises(StartError, match=r"sim exited \(3\)[\s\S]*no such model"):
        group.start(child, 30.0)


def test_a_child_that_never_answers_fails_at_its_deadline(tmp_path: Path) -> None:
    child = _noter(tmp_path, "mute")
    child.ready_url = loopback_url(free_ports(1)[0])  # nothing listens there
    with ChildGroup() as group, pytest.raises(StartError, match="mute not ready at"):
        group.start(child, 0.5)
    assert not child.alive()  # the group stopped it


def test_abort_ends_the_wait_without_an_error(tmp_path: Path) -> None:
    child = _noter(tmp_path, "slow")
    child.ready_url = loopback_url(free_ports(1)[0])
    with ChildGroup() as group:
        assert group.start(child, 30.0, abort=lambda: True) is False


def test_the_group_stops_the_last_started_first(tmp_path: Path) -> None:
    group = ChildGroup([_noter(tmp_path, n) for n in ("sim", "collect", "control", "proxy")])
    for child in group:
        child.start()
    for child in group:
        _wait_started(child)
    assert group.stop() == []
    assert (tmp_path / "notes").read_text().split() == ["proxy", "control", "collect", "sim"]


def test_a_child_that_ignores_term_is_killed_after_the_grace(tmp_path: Path) -> None:
    child = _noter(tmp_path, "stubborn", ignore=True)
    child.start()
    _wait_started(child)
    assert child.stop(grace_s=0.2)
    assert child.returncode() == -9
    assert child.stop()  # stopping a stopped child is a no-op


def test_a_paused_child_is_continued_to_take_its_term(tmp_path: Path) -> None:
    child = _noter(tmp_path, "paused")
    child.start()
    _wait_started(child)
    child.signal(signal.SIGSTOP)
    assert child.stop(grace_s=30.0)
    assert (tmp_path / "notes").read_text().split() == ["paused"]  # it ran its TERM handler


def test_a_restart_appends_to_the_log(tmp_path: Path) -> None:
    child = Child("echo", [sys.executable, "-c", "print('line')"], tmp_path / "echo.log")
    (tmp_path / "echo.log").write_text("an earlier run\n")
    for _ in range(2):
        child.start()
        assert child.proc is not None
        child.proc.wait(timeout=30)
    assert child.log().split("\n")[:2] == ["line", "line"]  # the first start truncated the old log
