"""Leadership with a lock the test holds in its hand: one leader, one standby on one store (SQLite and,
in the pg tier, PostgreSQL), the standby serving what the leader stored and refusing changes with a
409 that names the leader, a takeover bumping the epoch, the deposed leader writing nothing; the
SQLite file lock (exactly one controller); /healthz and /metrics saying who leads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from controller.api import create_app
from controller.cli import serve
from controller.leader import (
    AlreadyRunning,
    Deposed,
    FileLock,
    NotLeader,
    PgAdvisoryLock,
    SoleLeader,
    lock_path_for,
    open_leadership,
)
from controller.loop import Reconciler
from controller.wiring import default_effects
from store.db import transaction
from store.models import ControllerLeader
from tests.controller.conftest import World
from tests.controller.leaders import HandLeadership, HandLock, decisions, feed, served, writes
from tests.controller.seed import settings_yaml

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DRAIN = {"reason": "kernel upgrade"}


def pair(world: World) -> tuple[HandLock, Reconciler, Reconciler]:
    lock = HandLock()
    a, b = (
        Reconciler(
            world.settings,
            world.factory,
            effects=default_effects(world.settings, world.factory, clock=world.clock),
            clock=world.clock,
            alert_config=world.reconciler.alert_config,
            leadership=HandLeadership(lock, name),
        )
        for name in ("ctl-a:8300 (pid 1)", "ctl-b:8300 (pid 2)")
    )
    return lock, a, b


def test_one_leads_one_stands_by_then_a_takeover_fences_the_old_leader(world: World) -> None:
    lock, a, b = pair(world)
    feed(world)
    assert a.step() is not None and a.role == "leader"  # took the lock, claimed an epoch, ticked
    epoch = a.view().epoch
    assert epoch is not None and a.table.leader_epoch == epoch
    assert b.step() is None and b.role == "standby"  # the lock is taken: B reloads from the store
    for _ in range(4):  # decode-2 hands off slowly: A cuts its weight and stores why
        feed(world, handoff_s={"decode-2": 0.5})
        a.step()
        b.step()
    assert served(a.table)["decode-2"][0] < 1.0
    assert served(b.table) == served(a.table)  # the standby serves the leader's stored weights
    assert b.table.leader_epoch == epoch and b.view().leader is not None
    assert b.view().leader.holder == "ctl-a:8300 (pid 1)"  # type: ignore[union-attr]
    assert decisions(world) and {e for _, e in decisions(world)} == {epoch}

    # the leader's lock is lost (its session ended): the standby's next step takes over
    lock.owner = None
    before = writes(world)
    feed(world, handoff_s={"decode-2": 0.5})
    assert b.step() is not None and b.role == "leader"
    assert b.view().epoch == epoch + 1 and b.table.leader_epoch == epoch + 1
    with transaction(world.factory) as s:
        row = s.get(ControllerLeader, 1)
        assert row is not None and (row.epoch, row.holder) == (epoch + 1, "ctl-b:8300 (pid 2)")
    assert b.view().takeovers == 1

    # the old leader, unaware, ticks: the fence stops it before it writes anything
    mid = writes(world)
    with pytest.raises(Deposed) as err:
        a.tick()
    assert "ctl-b:8300 (pid 2)" in err.value.detail and err.value.leader is not None
    assert err.value.leader.epoch == epoch + 1
    assert writes(world) == mid and a.role == "standby" and a.view().deposed == 1
    assert a.step() is None and a.role == "standby"  # B holds the lock now
    assert a.table.leader_epoch == epoch + 1
    assert before[0] <= mid[0]
    assert {e for _, e in decisions(world)} <= {epoch, epoch + 1}


def test_a_standby_serves_every_read_and_answers_409_to_a_change(world: World) -> None:
    _, a, b = pair(world)
    feed(world)
    a.step()
    b.step()
    leader_app, standby_app = create_app(a, token=TOKEN), create_app(b, token=TOKEN)
    with TestClient(leader_app) as lead, TestClient(standby_app) as stand:
        assert lead.post("/v1/instances/decode-1/drain", json=DRAIN, headers=AUTH).status_code == 200
        b.step()  # the standby's next interval: the drain is in the store, so it serves it
        table = stand.get("/v1/routing")
        assert table.status_code == 200 and table.headers["etag"]
        body = table.json()
        assert body["leader_epoch"] == a.view().epoch
        assert next(i for i in body["instances"] if i["name"] == "decode-1")["drained"] is True
        for path in ("/v1/pools", "/v1/instances/decode-1/weight", "/v1/decisions", "/v1/alerts", "/v1/slo"):
            assert stand.get(path).status_code == 200, path
        assert stand.get("/v1/instances/decode-1/weight").json()["source"] == "drain"

        before = writes(world)
        for method, path, body in (
            ("POST", "/v1/instances/decode-2/drain", DRAIN),
            ("PUT", "/v1/instances/decode-2/weight", {"weight": 0.5, "ttl_s": 60.0, "reason": "x"}),
            ("DELETE", "/v1/pools/decode/weight", {"reason": "x"}),
        ):
            r = stand.request(method, path, json=body, headers=AUTH)
            assert r.status_code == 409, (path, r.text)
            leader = r.json()["leader"]
            assert leader["holder"] == "ctl-a:8300 (pid 1)" and leader["epoch"] == a.view().epoch
            assert "standby" in r.json()["detail"] and "ctl-a:8300 (pid 1)" in r.json()["detail"]
        assert writes(world) == before
        # without a token a standby still says 401 first: the 409 tells nothing to the unauthenticated
        assert stand.post("/v1/instances/decode-2/drain", json=DRAIN).status_code == 401

        h = stand.get("/healthz").json()
        assert (h["status"], h["role"], h["leader_epoch"]) == ("ok", "standby", a.view().epoch)
        assert h["leader"]["holder"] == "ctl-a:8300 (pid 1)"
        m = stand.get("/metrics").text
        assert "pdscope_controller_leader 0.0" in m
        assert f"pdscope_controller_epoch {float(a.view().epoch or 0)}" in m


def test_a_standby_never_serves_two_tables_under_one_etag(world: World) -> None:
    """Its versions are its own, bumped when what it composes changes: an override that stores no
    decision (a pool's weight) still reaches a proxy polling with If-None-Match."""
    _, a, b = pair(world)
    feed(world)
    a.step()
    b.step()
    with TestClient(create_app(a, token=TOKEN)) as lead, TestClient(create_app(b, token=TOKEN)) as stand:
        first = stand.get("/v1/routing")
        etag = first.headers["etag"]
        b.step()
        assert stand.get("/v1/routing", headers={"If-None-Match": etag}).status_code == 304
        put = {"weight": 3.0, "ttl_s": 60.0, "reason": "shift load"}
        assert lead.put("/v1/pools/decode/weight", json=put, headers=AUTH).status_code == 200
        b.step()
        r = stand.get("/v1/routing", headers={"If-None-Match": etag})
        assert r.status_code == 200 and r.headers["etag"] != etag
        assert next(p for p in r.json()["pools"] if p["name"] == "decode")["weight"] == 3.0
        assert r.json()["version"] > first.json()["version"]


def test_a_proxy_polling_either_replica_applies_the_same_table(world: World) -> None:
    """The proxy's own poll (proxy.routing) against the leader, then the standby: it parses the table
    with its leader epoch and serves the same weights and drains from either."""
    import asyncio

    import httpx

    from proxy.routing import RoutingState, poll_once

    _, a, b = pair(world)
    for _ in range(4):
        feed(world, handoff_s={"decode-2": 0.5})
        a.step()
    with TestClient(create_app(a, token=TOKEN)) as lead:
        assert lead.post("/v1/instances/decode-0/drain", json=DRAIN, headers=AUTH).status_code == 200
    b.step()
    state = RoutingState(world.settings, 0.0)

    async def poll(rec: Reconciler) -> dict[str, float]:
        app = create_app(rec, token=TOKEN)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ctl") as c:
            await poll_once(state, c, "http://ctl/v1/routing", lambda: 1.0)
        assert state.view.state == "fresh"
        return {t.name: t.weight for t in (*state.view.prefill, *state.view.decode)}

    from_leader = asyncio.run(poll(a))
    from_standby = asyncio.run(poll(b))
    assert from_standby == from_leader and "decode-0" not in from_leader and from_leader["decode-2"] < 1.0
    assert state.table is not None and state.table.leader_epoch == a.view().epoch


def test_a_standby_that_takes_over_serves_no_lower_version(world: World) -> None:
    lock, a, b = pair(world)
    feed(world)
    a.step()
    for _ in range(3):
        b.step()
    served_version = b.table.version
    lock.owner = None
    feed(world)
    assert b.step() is not None and b.role == "leader"
    assert b.table.version >= served_version


def test_healthz_and_metrics_of_a_leader(world: World) -> None:
    world.step()
    with TestClient(create_app(world.reconciler, token=TOKEN)) as c:
        h = c.get("/healthz").json()
        assert (h["status"], h["role"]) == ("ok", "leader")
        assert h["leader_epoch"] == 1 and h["leader"]["epoch"] == 1  # a fresh store: the first takeover
        assert h["leader"]["holder"] == world.reconciler.leadership.holder
        m = c.get("/metrics").text
        assert "pdscope_controller_leader 1.0" in m and "pdscope_controller_epoch 1.0" in m
        assert "pdscope_controller_takeovers_total 1.0" in m and "pdscope_controller_deposed_total 0.0" in m
        assert c.post("/v1/instances/decode-0/drain", json=DRAIN, headers=AUTH).status_code == 200


def test_every_decision_and_the_table_carry_the_epoch(world: World) -> None:
    for _ in range(4):
        world.step(handoff_s={"decode-2": 0.5})
    epochs = {e for _, e in decisions(world)}
    assert epochs == {1} and world.reconciler.table.leader_epoch == 1
    with TestClient(create_app(world.reconciler, token=TOKEN)) as c:
        assert {d["leader_epoch"] for d in c.get("/v1/decisions").json()} == {1}
        assert c.get("/v1/routing").json()["leader_epoch"] == 1


def test_a_tick_on_a_standby_reads_and_writes_nothing(world: World) -> None:
    _, a, b = pair(world)
    feed(world)
    a.step()
    b.step()
    before = writes(world)
    with pytest.raises(NotLeader):
        b.tick()
    assert writes(world) == before


# -- SQLite: exactly one controller ------------------------------------------------------------------


def test_a_second_controller_on_one_sqlite_file_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import uvicorn

    settings = settings_yaml(f"sqlite:///{tmp_path / 's.db'}")
    seen: dict[str, Any] = {}

    def fake_run(app: Any, **kwargs: Any) -> None:  # while the first one serves, a second one starts
        seen["second"] = serve(settings, None)

    monkeypatch.setattr(uvicorn, "run", fake_run)
    assert serve(settings, None) == 0
    assert seen["second"] == 1
    err = capsys.readouterr().err
    assert "another controller already runs on" in err and f"pid {os.getpid()}" in err
    assert "exactly one controller" in err and "PostgreSQL" in err
    seen.clear()
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    assert serve(settings, None) == 0  # the first one stopped: its lock went with it


def test_the_sqlite_file_lock_names_its_holder_and_is_released(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    first = FileLock(db, "ctl-a:8300 (pid 1)")
    with pytest.raises(AlreadyRunning) as err:
        FileLock(db, "ctl-b:8300")
    assert str(lock_path_for(db)) in err.value.detail and "ctl-a:8300" in err.value.detail
    assert first.held() and first.acquire()
    first.release()
    assert not first.held()
    second = FileLock(db, "ctl-b:8300")
    assert not first.acquire()  # the second one holds it now
    second.release()
    assert first.acquire() and first.held()
    first.release()


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:"])
def test_in_memory_sqlite_needs_no_lock(url: str) -> None:
    assert isinstance(open_leadership(url, "me", 10.0), SoleLeader)


def test_postgresql_gets_the_advisory_lock_and_sqlite_files_the_file_lock(tmp_path: Path) -> None:
    lock = open_leadership(f"sqlite:///{tmp_path / 's.db'}", "me", 10.0)
    assert isinstance(lock, FileLock)
    lock.release()
    pg = open_leadership("postgresql://u@127.0.0.1:1/db", "me", 10.0)  # nothing is opened yet
    assert isinstance(pg, PgAdvisoryLock) and not pg.held()


@pytest.mark.slow
def test_a_second_pdscope_control_process_on_one_sqlite_file_exits_naming_the_first(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    import httpx

    from tests.support.sockets import free_port
    from tests.support.waiting import wait_until

    repo = Path(__file__).resolve().parents[2]

    def start(port: int) -> subprocess.Popen[bytes]:
        cfg = tmp_path / f"c{port}.yaml"
        cfg.write_text(f"""
model: {{name: m, kv_bytes_per_token: 1}}
pools:
  prefill: {{role: prefill, instances: [{{name: p0, url: "http://127.0.0.1:9"}}]}}
  decode: {{role: decode, instances: [{{name: d0, url: "http://127.0.0.1:9"}}]}}
store: {{url: "sqlite:///{tmp_path / "s.db"}"}}
controller: {{port: {port}, interval_s: 0.2, mode: advisory}}
""")
        return subprocess.Popen(
            [sys.executable, "-m", "pdscope.cli", "--config", str(cfg), "control"],
            cwd=repo,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    port = free_port()
    first = start(port)
    try:
        wait_until(
            "the first controller to lead",
            lambda: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).json(),
            done=lambda h: h["role"] == "leader" and h["ticks"] >= 1,
            timeout_s=30,
            every_s=0.2,
            ignore=(httpx.HTTPError,),
        )
        second = start(free_port())
        out, _ = second.communicate(timeout=60)
        assert second.returncode == 1
        text = out.decode(errors="replace")
        assert "another controller already runs on" in text and f"pid {first.pid}" in text, text
    finally:
        first.send_signal(signal.SIGTERM)
        try:
            first.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            first.kill()
            first.communicate()


def test_a_holder_name_carries_its_api_address() -> None:
    from controller.leader import advertise_url, default_holder, leader_url

    holder = default_holder(8300, "http://10.0.3.7:8300")
    assert holder.endswith(" at http://10.0.3.7:8300") and leader_url(holder) == "http://10.0.3.7:8300"
    assert leader_url(default_holder(8300)) is None  # no address: nothing to forward to
    assert leader_url("ctl-0:8300 (pid 1) at nowhere") is None
    assert advertise_url("127.0.0.1", 8300, None) == "http://127.0.0.1:8300"
    assert advertise_url("::1", 8300, None) == "http://[::1]:8300"
    assert advertise_url("0.0.0.0", 8300, "https://ctl.example/") == "https://ctl.example"
    assert advertise_url("0.0.0.0", 8300, None).endswith(":8300")  # the host name's address
