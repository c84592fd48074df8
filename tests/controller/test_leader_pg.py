"""Leadership on PostgreSQL, for real: the session advisory lock on its own connection, the takeover
when the leader's lock connection is terminated, the fence that keeps the old leader from writing,
a takeover that waits for a tick in flight, and a paused leader losing the lock and its tick."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.exc import DBAPIError

from controller import observe as observe_mod
from controller.api import create_app
from controller.leader import Deposed, LeaderInfo, PgAdvisoryLock, claim, fence, read_leader
from controller.loop import Reconciler
from controller.wiring import default_effects
from store.db import StoreError, make_engine, session_factory, transaction
from store.migrate import upgrade
from store.models import Decision, TickRecord
from tests.controller.conftest import World
from tests.controller.leaders import decisions, feed, served, writes
from tests.support.sockets import free_port
from tests.support.waiting import wait_until

pytestmark = pytest.mark.pg

REPO = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def store_url(pg_database: str) -> str:
    """This module's stores are PostgreSQL only (the ``world`` fixture reads this one)."""
    with psycopg.connect(pg_database, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
    return pg_database


def admin(url: str, sql: str, **params: object) -> list[tuple[object, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        return list(conn.execute(sql, params).fetchall())


def a_decision(ts: float, epoch: int) -> Decision:
    return Decision(
        ts=ts,
        tick=1,
        mode="enforce",
        subject_kind="instance",
        subject="decode-0",
        field="weight",
        old_value=1.0,
        new_value=0.5,
        reason="SlowHandoff",
        message="m",
        leader_epoch=epoch,
    )


def backend_gone(url: str, pid: int) -> bool:
    return not admin(url, "SELECT 1 FROM pg_stat_activity WHERE pid = %(pid)s", pid=pid)


@pytest.fixture
def contenders(world: World, store_url: str) -> Iterator[tuple[Reconciler, Reconciler]]:
    locks = [
        PgAdvisoryLock(store_url, holder, world.reconciler.lease_s)
        for holder in ("ctl-a:8300 (pid 1)", "ctl-b:8300 (pid 2)")
    ]
    a, b = (
        Reconciler(
            world.settings,
            world.factory,
            effects=default_effects(world.settings, world.factory, clock=world.clock),
            clock=world.clock,
            alert_config=world.reconciler.alert_config,
            leadership=lock,
        )
        for lock in locks
    )
    yield a, b
    for lock in locks:
        lock.close()


def test_terminating_the_leaders_lock_connection_hands_over_and_fences_the_old_leader(
    world: World, store_url: str, contenders: tuple[Reconciler, Reconciler]
) -> None:
    a, b = contenders
    feed(world)
    assert a.role == b.role == "standby"  # no lock tried yet
    assert a.step() is not None and a.role == "leader"
    assert b.step() is None and b.role == "standby"
    first = a.view().epoch
    assert first == 1
    for _ in range(4):
        feed(world, handoff_s={"decode-2": 0.5})
        a.step()
        b.step()
    assert served(b.table) == served(a.table) and served(a.table)["decode-2"][0] < 1.0
    assert b.table.leader_epoch == 1 and {e for _, e in decisions(world)} == {1}
    last_of_a = decisions(world)[-1][0]

    pid = a.leadership.backend_pid  # type: ignore[attr-defined]
    assert admin(store_url, "SELECT pg_terminate_backend(%(pid)s)", pid=pid) == [(True,)]
    wait_until("the leader's lock session to end", lambda: backend_gone(store_url, pid))
    assert b.step() is not None and b.role == "leader"  # the standby's next step takes over
    assert b.view().epoch == 2 and b.table.leader_epoch == 2
    with transaction(world.factory) as s:
        assert read_leader(s) == LeaderInfo(2, "ctl-b:8300 (pid 2)", world.clock())

    # the old leader has not noticed yet (its next tick will): an operator change sent to it is
    # fenced like a tick, a 409 naming the new leader, and nothing is written
    before = writes(world)
    assert a.role == "leader"
    with TestClient(create_app(a, token=TOKEN)) as c:
        r = c.post("/v1/instances/decode-1/drain", json={"reason": "x"}, headers=AUTH)
    assert r.status_code == 409, r.text
    assert r.json()["leader"]["epoch"] == 2 and writes(world) == before

    # the old leader's next tick: fenced, nothing written, and it says so
    with pytest.raises(Deposed):
        a.tick()
    assert writes(world) == before and a.role == "standby"
    assert a.step() is None and a.role == "standby" and a.table.leader_epoch == 2  # B holds the lock
    with TestClient(create_app(a, token=TOKEN)) as c:
        r = c.post("/v1/instances/decode-1/drain", json={"reason": "x"}, headers=AUTH)
        assert r.status_code == 409 and r.json()["leader"]["holder"] == "ctl-b:8300 (pid 2)"
        assert r.json()["leader"]["epoch"] == 2
        h = c.get("/healthz").json()
        assert (h["role"], h["leader_epoch"], h["leader"]["holder"]) == ("standby", 2, "ctl-b:8300 (pid 2)")
        assert "pdscope_controller_leader 0.0" in c.get("/metrics").text
    assert writes(world) == before

    # the new leader decides (decode-1 now slow) and its decisions carry its epoch
    for _ in range(4):
        feed(world, handoff_s={"decode-1": 0.5})
        b.step()
        a.step()
    rows = decisions(world)
    assert {e for i, e in rows if i <= last_of_a} == {1}
    assert {e for i, e in rows if i > last_of_a} == {2}
    assert served(a.table) == served(b.table) and served(b.table)["decode-1"][0] < 1.0


def test_a_takeover_waits_for_the_tick_in_flight_to_commit(world: World, store_url: str) -> None:
    """The old leader's tick holds the epoch row's share lock from its fence to its commit; the new
    leader's claim waits for it, so what that tick wrote is in the store before the new one reloads."""
    lease = world.reconciler.lease_s
    with transaction(world.factory) as s:
        mine = claim(s, "old", world.clock(), lease)[1].epoch
    tick = world.factory()
    fence(tick, mine, lease)
    tick.add(a_decision(world.clock(), mine))
    tick.flush()
    got: list[LeaderInfo] = []

    def take_over() -> None:
        with transaction(world.factory) as s:
            got.append(claim(s, "new", world.clock(), lease)[1])

    t = threading.Thread(target=take_over)
    t.start()
    waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'UPDATE%%'"
    wait_until("the takeover to wait on the epoch row", lambda: admin(store_url, waiting) == [(1,)])
    assert not got
    tick.commit()
    tick.close()
    t.join(timeout=30)
    assert got and got[0].epoch == mine + 1
    assert [e for _, e in decisions(world)] == [mine]  # the old tick's write is stored, under its epoch
    with transaction(world.factory) as s, pytest.raises(Deposed):
        fence(s, mine, lease)


def test_a_paused_leader_loses_its_lock_and_its_tick_in_flight(store_url: str) -> None:
    """A leader that stops (SIGSTOP) neither pings its lock nor finishes its tick: past the lease the
    server ends both sessions, the standby takes the lock and the epoch, and the resumed leader's
    commit fails: it wrote nothing."""
    upgrade(store_url)
    engine = make_engine(store_url)
    factory = session_factory(engine)
    lease = 1.0
    old, new = PgAdvisoryLock(store_url, "old", lease), PgAdvisoryLock(store_url, "new", lease)
    try:
        assert old.acquire() and not new.acquire()
        with transaction(factory) as s:
            mine = claim(s, "old", 0.0, lease)[1].epoch
        tick = factory()
        fence(tick, mine, lease)
        tick.add(a_decision(0.0, mine))
        tick.flush()  # then the process is paused: the tick sits idle in its transaction
        assert wait_until("the standby to take the lock", new.acquire, timeout_s=60, every_s=0.2)

        def take_epoch() -> LeaderInfo:
            with transaction(factory) as s:
                return claim(s, "new", 1.0, lease)[1]

        info = wait_until(
            "the epoch row to be free", take_epoch, timeout_s=60, every_s=0.2, ignore=(StoreError,)
        )
        assert info.epoch == mine + 1
        assert not old.held()  # resumed: its lock session is gone ...
        with pytest.raises(DBAPIError):  # ... and so is its tick's: the commit fails, nothing is written
            tick.commit()
        tick.close()
        with transaction(factory) as s:
            assert read_leader(s) == LeaderInfo(mine + 1, "new", 1.0)
            assert s.scalars(select(Decision)).all() == []
    finally:
        old.close()
        new.close()
        engine.dispose()


def _controller(store_url: str, port: int, tmp_path: Path) -> subprocess.Popen[bytes]:
    cfg = tmp_path / f"pdscope-{port}.yaml"
    cfg.write_text(f"""
model: {{name: m, kv_bytes_per_token: 1}}
pools:
  prefill: {{role: prefill, instances: [{{name: p0, url: "http://127.0.0.1:9"}}]}}
  decode: {{role: decode, instances: [{{name: d0, url: "http://127.0.0.1:9"}}]}}
store: {{url: "{store_url}"}}
controller: {{port: {port}, interval_s: 0.5, mode: advisory}}
""")
    return subprocess.Popen(
        [sys.executable, "-m", "pdscope.cli", "--config", str(cfg), "control"],
        cwd=REPO,
        env={**os.environ, "PDSCOPE_API_TOKEN": TOKEN},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _health(port: int) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).json()
    return body


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_controller_processes_through_sigstop_and_kill_9_of_the_leader(
    store_url: str, tmp_path: Path
) -> None:
    """Two ``pdscope control`` processes on one store: one leads, one stands by. The leader paused
    (SIGSTOP) past its lease loses the lock to the standby and, resumed, finds itself deposed; the new
    leader killed (-9) hands the lock back at once. Each takeover bumps the epoch."""
    ports = [free_port(), free_port()]
    procs = [_controller(store_url, port, tmp_path) for port in ports]
    try:
        roles = wait_until(
            "one leader and one standby",
            lambda: [_health(p) for p in ports],
            done=lambda hs: sorted(h["role"] for h in hs) == ["leader", "standby"] and hs[0]["leader"],
            timeout_s=60,
            every_s=0.2,
            ignore=(httpx.HTTPError, ValueError),
        )
        first = next(i for i, h in enumerate(roles) if h["role"] == "leader")
        other = 1 - first
        epoch = roles[first]["leader_epoch"]
        r = httpx.post(
            f"http://127.0.0.1:{ports[other]}/v1/instances/d0/drain",
            json={"reason": "x"},
            headers=AUTH,
            timeout=5,
        )
        assert r.status_code == 200, r.text  # the standby forwarded it to the leader
        assert r.headers["x-pdscope-forwarded-to"] == f"http://127.0.0.1:{ports[first]}"
        r = httpx.post(
            f"http://127.0.0.1:{ports[other]}/v1/instances/d0/undrain",
            json={"reason": "x"},
            headers={**AUTH, "X-Pdscope-Forwarded-By": "a test"},
            timeout=5,
        )
        assert r.status_code == 409, r.text  # forwarded once already: the standby's own answer
        assert f":{ports[first]} (pid {procs[first].pid}) at http://" in r.json()["leader"]["holder"]

        procs[first].send_signal(signal.SIGSTOP)  # paused: it neither pings its lock nor ticks
        took = wait_until(
            "the standby to take over from the paused leader",
            lambda: _health(ports[other]),
            done=lambda h: h["role"] == "leader",
            timeout_s=90,
            every_s=0.2,
            ignore=(httpx.HTTPError,),
        )
        assert took["leader_epoch"] == epoch + 1
        procs[first].send_signal(signal.SIGCONT)
        back = wait_until(
            "the resumed leader to find itself deposed",
            lambda: _health(ports[first]),
            done=lambda h: h["role"] == "standby" and h["leader_epoch"] == epoch + 1,
            timeout_s=60,
            every_s=0.2,
            ignore=(httpx.HTTPError,),
        )
        assert f"(pid {procs[other].pid})" in back["leader"]["holder"]

        procs[other].kill()  # -9: its sessions end with the process, and the lock with them
        procs[other].wait(timeout=30)
        again = wait_until(
            "the old leader to take over again",
            lambda: _health(ports[first]),
            done=lambda h: h["role"] == "leader",
            timeout_s=60,
            every_s=0.2,
            ignore=(httpx.HTTPError,),
        )
        assert again["leader_epoch"] == epoch + 2
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait(timeout=30)


def test_a_standby_forwards_an_operator_change_to_the_leader_once(world: World, store_url: str) -> None:
    """The leader keeps its API address with its leadership; a change sent to the standby is passed on
    to it (and answered as the leader answers), never twice, and is a 409 naming the leader when it
    cannot be reached."""
    from controller.leader import default_holder
    from tests.support.serving import serve_in_thread
    from tests.support.sockets import bound_socket, url_of

    sock = bound_socket()
    leader_api = url_of(sock)
    locks = [
        PgAdvisoryLock(store_url, default_holder(8300, leader_api), world.reconciler.lease_s),
        PgAdvisoryLock(store_url, default_holder(8301, "http://127.0.0.1:9"), world.reconciler.lease_s),
    ]
    a, b = (
        Reconciler(
            world.settings,
            world.factory,
            effects=default_effects(world.settings, world.factory, clock=world.clock),
            clock=world.clock,
            leadership=lock,
        )
        for lock in locks
    )
    try:
        feed(world)
        assert a.step() is not None and a.role == "leader"
        assert b.step() is None and b.role == "standby"
        before = writes(world)
        with (
            serve_in_thread(create_app(a, token=TOKEN), sock=sock),
            TestClient(create_app(b, token=TOKEN)) as c,
        ):
            r = c.post("/v1/instances/decode-1/drain", json={"reason": "disk"}, headers=AUTH)
            assert r.status_code == 200, r.text
            assert r.headers["x-pdscope-forwarded-to"] == leader_api
            assert r.json()["drained"] is True
            assert writes(world)[1:] == (before[1] + 1, before[2] + 1)  # one override, one audit event
            # marked as forwarded already: the standby answers its own 409
            again = c.post(
                "/v1/instances/decode-1/undrain",
                json={"reason": "x"},
                headers={**AUTH, "X-Pdscope-Forwarded-By": "elsewhere"},
            )
            assert again.status_code == 409 and again.json()["leader"]["url"] == leader_api
            # an unauthenticated change is refused by the standby itself, before any forward
            assert c.post("/v1/instances/decode-1/undrain", json={"reason": "x"}).status_code == 401
        with TestClient(create_app(b, token=TOKEN)) as c:  # the leader's API is gone now
            r = c.post("/v1/instances/decode-1/undrain", json={"reason": "x"}, headers=AUTH)
            assert r.status_code == 409 and "forwarding to the leader at" in r.json()["detail"]
            assert (
                'pdscope_controller_changes_forwarded_total{outcome="failed"} 1.0' in c.get("/metrics").text
            )
    finally:
        for lock in locks:
            lock.close()


def test_a_tick_whose_observation_outlasts_the_lease_still_writes(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 10,000 instances the observation computes for longer than the lease between two statements.
    The fence's transaction may not sit idle that long (the server ends it, as it must for a paused
    leader), so the tick reads in a transaction of its own: here an observation that takes a second
    against a lease of 0.3 s, and the tick still commits its record under its epoch."""
    rec = world.reconciler
    rec.lease_s = 0.3
    observe = observe_mod.observe

    def slow(*args: Any, **kwargs: Any) -> Any:
        got = observe(*args, **kwargs)
        time.sleep(1.0)  # the computing a large fleet's observation does between statements
        return got

    monkeypatch.setattr(observe_mod, "observe", slow)
    feed(world)
    rec.tick()
    feed(world)
    rec.tick()
    with transaction(world.factory) as s:
        epochs = s.scalars(select(TickRecord.leader_epoch)).all()
    assert len(epochs) == 2 and set(epochs) == {rec.view().epoch}
