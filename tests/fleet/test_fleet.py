"""The fleet tier: 3 proxies, 2 controllers and 2 collectors on one PostgreSQL store, against a
simulated 2P+4D fleet, each a process of its own (``tests/support/fleet.py``), through the faults
issue 16 names: the leader controller killed (-9) and paused (SIGSTOP) under load, a collector and a
proxy killed, a trace split across collectors, PostgreSQL restarted under load, and the pools'
in-flight sum held under a burst through all the proxies. Each assertion reads its evidence from
the store, ``/metrics``, ``/healthz`` or the client's own record of every request."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.exc import SQLAlchemyError

from tests.fleet.conftest import PrivatePg
from tests.support.fleet import (
    HTTP_ERRORS,
    Fleet,
    FleetShape,
    InflightSampler,
    Load,
    Service,
    by_label,
    summarize,
)
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.fleet, pytest.mark.timeout(240)]

# 2P+4D, 3 proxies, 2 controllers, 2 collectors; ticks and scrapes every 0.5 s; the controller judges
# 5 s windows from 1 s on, so a fault the test injects gets a decision within a few ticks
SHAPE = FleetShape(controller={"window_s": 5.0, "noise": {"startup_s": 1.0}})


@pytest.fixture
def fleet(fleet_store: str, tmp_path: Path) -> Iterator[Fleet]:
    with Fleet(SHAPE, fleet_store, tmp_path / "fleet") as f:
        yield f


def lease_s(shape: FleetShape) -> float:
    """The leader lock's lease for these ticks (controller.leader.lease_for: max(10 s, 5 intervals))."""
    from controller.leader import lease_for

    return lease_for(shape.interval_s)


def decisions(f: Fleet) -> list[tuple[int, float, str, str, int | None]]:
    """(id, ts, subject, reason, leader_epoch) of every stored decision, oldest first."""
    return [
        (int(i), float(ts), str(s), str(r), e)
        for i, ts, s, r, e in f.query(
            "SELECT id, ts, subject, reason, leader_epoch FROM decisions ORDER BY id"
        )
    ]


def provoke_decision(f: Fleet, after_id: int, decode: str) -> list[tuple[int, float, str, str, int | None]]:
    """Make one decode's links 50x slower (the simulator's admin API) until the leader stores a
    decision newer than ``after_id`` (a SlowHandoff cut, or any other); returns the new decisions."""
    r = httpx.post(
        f.admin_url + "/faults", json={"kind": "slow_nic", "decode": decode, "factor": 50.0}, timeout=5
    )
    assert r.status_code == 200, r.text
    try:
        return wait_until(
            f"a decision after #{after_id} (slow links into {decode})",
            lambda: [d for d in decisions(f) if d[0] > after_id],
            timeout_s=30,
            every_s=0.1,
        )
    finally:
        httpx.delete(f.admin_url + "/faults", timeout=5)


def proxies_follow(f: Fleet, epoch: int, proxies: list[Service] | None = None) -> None:
    """Wait until every (given) proxy applies a fresh table carrying ``epoch`` -- possible only when
    the proxies can poll a live controller (``proxy.controller_urls``, or the one they poll lives)."""
    want = proxies if proxies is not None else f.proxies

    def states() -> list[str | None]:
        return [p.health().get("routing") for p in want]

    wait_until("every proxy to apply a fresh table", states, done=lambda s: set(s) == {"fresh"}, timeout_s=20)
    for c in f.controllers:
        if c.alive():
            table = c.get("/v1/routing").json()
            assert table.get("leader_epoch") == epoch, (
                f"{c.name} serves a table of epoch {table.get('leader_epoch')}"
            )


# -- a. the leader killed under load ---------------------------------------------------


def test_the_standby_takes_over_from_a_killed_leader_and_the_proxies_keep_serving(fleet: Fleet) -> None:
    f = fleet
    leader = f.wait_for_leader()
    standby = next(c for c in f.controllers if c is not leader)
    epoch = leader.health()["leader_epoch"]
    with Load(f.proxy_urls, rate=20, max_requests=400, duration_s=14) as load:
        wait_until(
            "load through every proxy",
            lambda: {r.proxy for r in load.results if r.ok},
            done=lambda s: len(s) == 3,
        )
        before = decisions(f)
        t_kill = time.monotonic()
        leader.kill9()
        took = wait_until(
            f"{standby.name} to lead after the kill -9 of {leader.name}",
            standby.health,
            done=lambda h: h["role"] == "leader" and h["ticks"] > 0 and h["last_success"] is not None,
            timeout_s=60,
            every_s=0.05,
            ignore=HTTP_ERRORS,
        )
        takeover_s = time.monotonic() - t_kill
        bound = lease_s(SHAPE) + 2 * SHAPE.interval_s
        print(
            f"leader takeover after kill -9: {takeover_s:.2f}s (bound: lease {lease_s(SHAPE):g}s + 2 ticks)"
        )
        assert takeover_s <= bound, f"takeover took {takeover_s:.2f}s, over the lease + 2 ticks ({bound:g}s)"
        assert took["leader_epoch"] == epoch + 1, f"the epoch did not bump: {took}"
        assert took["leader"]["holder"].count(f"(pid {standby.pid})") == 1, took
        provoke_decision(f, max((d[0] for d in before), default=0), "decode-1")
        wait_until(
            "client requests answered after the takeover",
            lambda: [r for r in load.sent_since(t_kill) if r.ok],
            done=lambda rs: len(rs) >= 30,
            timeout_s=20,
        )
        load.stop()
    results = load.results
    after = [d for d in decisions(f) if d[0] > max((d[0] for d in before), default=0)]
    assert after, "the new leader stored no decision"
    assert {d[4] for d in after} == {epoch + 1}, f"decisions after the takeover carry other epochs: {after}"
    assert {d[4] for d in before} <= {epoch}, f"decisions before the kill: {before}"
    failed = [r for r in results if not r.ok]
    assert not failed, f"client requests failed while the controller changed hands: {summarize(results)}"
    assert len([r for r in results if r.sent >= t_kill]) >= 30, summarize(results)
    if "controller_urls" in f.config_of(f.proxies[0])["proxy"]:
        proxies_follow(f, epoch + 1)
    # the killed leader's ticks and the new leader's, across the takeover, replay exactly as stored
    replayed = standby.get("/v1/replay?since=1h", timeout_s=60).json()
    assert replayed["reproduced"] is True, replayed["mismatches"][:3]
    assert replayed["restarts"] >= 1 and replayed["ticks"] > 5, {
        k: replayed[k] for k in ("restarts", "ticks")
    }


# -- b. the leader paused past its lock, then resumed -------------------------------------


def test_a_leader_paused_past_its_lock_finds_itself_deposed_and_writes_nothing(fleet: Fleet) -> None:
    f = fleet
    leader = f.wait_for_leader()
    standby = next(c for c in f.controllers if c is not leader)
    epoch = leader.health()["leader_epoch"]
    with Load(f.proxy_urls, rate=10, max_requests=400, duration_s=35) as load:
        wait_until(
            "load through every proxy",
            lambda: {r.proxy for r in load.results if r.ok},
            done=lambda s: len(s) == 3,
        )
        t_stop = time.monotonic()
        leader.pause()
        try:
            took = wait_until(
                f"{standby.name} to take the lock of the paused {leader.name}",
                standby.health,
                done=lambda h: h["role"] == "leader" and h["leader_epoch"] == epoch + 1 and h["ticks"] > 0,
                timeout_s=lease_s(SHAPE) + 30,
                every_s=0.1,
                ignore=HTTP_ERRORS,
            )
            paused_s = time.monotonic() - t_stop
            print(f"takeover from a paused leader: {paused_s:.2f}s (lease {lease_s(SHAPE):g}s)")
            assert paused_s <= lease_s(SHAPE) + 2 * SHAPE.interval_s + 5, f"takeover took {paused_s:.2f}s"
            since = float(took["leader"]["since"])
            last_old = max((d[0] for d in decisions(f)), default=0)
            new = provoke_decision(f, last_old, "decode-2")  # the new leader decides, under epoch + 1
            assert {d[4] for d in new} == {epoch + 1}, f"decisions while {leader.name} was paused: {new}"
            first_new = min(d[0] for d in new)
        finally:
            leader.resume()
        back = wait_until(
            f"the resumed {leader.name} to find itself deposed",
            leader.health,
            done=lambda h: h["role"] == "standby" and h["leader_epoch"] == epoch + 1,
            timeout_s=30,
            every_s=0.1,
            ignore=HTTP_ERRORS,
        )
        assert back["leader"]["holder"].count(f"(pid {standby.pid})") == 1, back
        ticks = back["ticks"]
        wait_until(
            f"{leader.name} to run a few standby rounds",
            leader.health,
            done=lambda h: h["ticks"] >= ticks + 4,
            ignore=HTTP_ERRORS,
        )
        assert by_label(leader.metrics()["pdscope_controller_leader"], "") == {"": 0.0}
        assert "standby:" in leader.log() and "writes nothing from now on" in leader.log(), leader.tail()
        # a change sent to it is forwarded to the new leader, which writes it ...
        r = f.post_controller(leader, "/v1/instances/decode-0/drain", {"reason": "to a deposed leader"})
        assert r.status_code == 200 and r.headers["x-pdscope-forwarded-to"] == standby.url, r.text
        # ... and one it may not forward (forwarded once already) it refuses itself, naming the new leader
        r = f.post_controller(
            leader, "/v1/instances/decode-0/undrain", {"reason": "x"}, headers={"X-Pdscope-Forwarded-By": "t"}
        )
        assert r.status_code == 409 and r.json()["leader"]["epoch"] == epoch + 1, r.text
        load.stop()
    rows = decisions(f)
    late = [d for d in rows if d[4] == epoch and (d[0] > first_new or d[1] > since)]
    assert not late, f"the deposed leader (epoch {epoch}) committed after the takeover: {late}"
    assert {d[4] for d in rows} <= {epoch, epoch + 1}, rows
    failed = [r for r in load.results if not r.ok]
    assert not failed, f"client requests failed while the leader was paused: {summarize(load.results)}"


# -- c. one collector killed --------------------------------------------------------------


def snapshot_counts(f: Fleet, since: float, until: float) -> dict[str, int]:
    rows = f.query(
        "SELECT instance, count(*) FROM snapshots WHERE ts >= :a AND ts < :b GROUP BY instance",
        a=since,
        b=until,
    )
    return {str(i): int(n) for i, n in rows}


def newest_snapshots(f: Fleet) -> dict[str, float]:
    return {str(i): float(t) for i, t in f.query("SELECT instance, max(ts) FROM snapshots GROUP BY instance")}


def collectors_view(c: Service) -> dict[str, Any]:
    view: dict[str, Any] = c.health()["collectors"]
    return view


def test_a_dead_collectors_targets_are_taken_over_and_none_is_scraped_twice(fleet: Fleet) -> None:
    f = fleet
    every = SHAPE.scrape_interval_s
    names = set(f.instances)
    views = wait_until(
        "both collectors live, their shares covering the fleet",
        lambda: [collectors_view(c) for c in f.collectors],
        done=lambda vs: (
            all(v["state"] == "ok" and len(v["live"]) == 2 for v in vs)
            and sum(v["owned_targets"] for v in vs) == len(names)
        ),
        timeout_s=30,
        ignore=HTTP_ERRORS,
    )
    assert all(v["owned_targets"] > 0 for v in views), views
    # steady state: each instance scraped once an interval, not twice (two collectors would double it)
    t0 = time.time()
    wait_until("a steady window of scrapes", time.time, done=lambda t: t >= t0 + 8 * every, every_s=every)
    counts = snapshot_counts(f, t0, t0 + 8 * every)
    assert set(counts) == names, f"instances without snapshots in steady state: {names - set(counts)}"
    assert max(counts.values()) <= 8 * 1.4 + 1, f"an instance was scraped by both collectors: {counts}"

    victim, survivor = f.collectors
    with Load(f.proxy_urls, rate=10, max_requests=200, duration_s=12) as load:
        t_kill = time.time()
        victim.kill9()
        fresh = wait_until(
            "every instance to get a snapshot newer than the kill",
            lambda: newest_snapshots(f),
            done=lambda n: set(n) == names and min(n.values()) > t_kill,
            timeout_s=30,
            every_s=0.05,
        )
        took_s = time.time() - t_kill
        print(f"collector takeover: every instance fresh {took_s:.2f}s after the kill ({every:g}s intervals)")
        # its heartbeat ages out over the live window (3 intervals); then one round and one scrape
        bound = 3 * every + 2 * every + 1.0
        assert took_s <= bound, (
            f"the dead collector's targets went unscraped {took_s:.2f}s (bound {bound:g}s): {fresh}"
        )
        view = wait_until(
            "the survivor to own every instance alone",
            lambda: collectors_view(survivor),
            done=lambda v: v["live"] == [survivor.name] and v["owned_targets"] == len(names),
            timeout_s=10,
            ignore=HTTP_ERRORS,
        )
        assert view["shares"] == {survivor.name: len(names)}, view
        owned = survivor.metrics()["pdscope_collector_owned_targets"]
        assert list(owned.values()) == [float(len(names))], owned
    t1 = time.time()
    wait_until(
        "a steady window after the takeover", time.time, done=lambda t: t >= t1 + 6 * every, every_s=every
    )
    counts = snapshot_counts(f, t1, t1 + 6 * every)
    assert set(counts) == names and max(counts.values()) <= 6 * 1.4 + 1, counts
    assert all(r.ok for r in load.results), summarize(load.results)


# -- d. one request's spans split across the two collectors ----------------------------------


RECORD_COLUMNS = (
    "status",
    "p_instance",
    "d_instance",
    "prompt_tokens",
    "completion_tokens",
    "p_queue_s",
    "p_prefill_s",
    "d_queue_s",
    "d_prefill_s",
    "d_decode_s",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "slo_met",
)


def _expected(spans: list[Any], slo: Any) -> dict[str, Any]:
    from collector.assemble import assemble

    rec = assemble(spans, slo)
    assert rec is not None
    return {c: getattr(rec, c) for c in RECORD_COLUMNS}


def test_a_trace_split_across_the_collectors_becomes_exactly_one_correct_record(
    fleet_store: str, tmp_path: Path
) -> None:
    """Half of each request's spans to one collector, half to the other, both posted at once (many
    requests, so the two collectors' merges of one record race): one record per request, whose every
    column is what one process assembling all the spans would give."""
    from pdscope import semconv as sc
    from pdscope.config import parse_config
    from tests.collector.traces import request_spans, to_proto

    shape = FleetShape(proxies=0, controllers=0, sim_tracing=False)
    with Fleet(shape, fleet_store, tmp_path / "fleet") as f:
        import yaml

        slo = parse_config(yaml.safe_dump(f.base_config())).slo
        a, b = f.collectors
        traces = []
        for i in range(40):
            spans = request_spans(request_id=f"split-{i}", p="prefill-0", d=f"decode-{i % 4}", tokens=9 + i)
            vllm = [s for s in spans if s.name == sc.VLLM_SPAN]
            proxy = [s for s in spans if s.name != sc.VLLM_SPAN]
            root_side, vllm_side = (a, b) if i % 2 else (b, a)  # the root lands on either
            # P's llm_request goes with the root, D's (the completion tokens, D's stages) to the other
            traces.append((f"split-{i}", [(root_side, proxy + vllm[:1]), (vllm_side, vllm[1:])], spans))

        barrier = threading.Barrier(2)
        errors: list[str] = []

        def post(side: int) -> None:
            barrier.wait(10)
            with httpx.Client(timeout=10) as client:
                for _, parts, _ in traces:
                    target, spans = parts[side]
                    r = client.post(
                        target.url + "/v1/traces",
                        content=to_proto(spans),
                        headers={"Content-Type": "application/x-protobuf"},
                    )
                    if r.status_code != 200:
                        errors.append(f"{target.name}: {r.status_code} {r.text[:200]}")

        threads = [threading.Thread(target=post, args=(side,)) for side in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        rids = [rid for rid, _, _ in traces]
        cols = ", ".join(RECORD_COLUMNS)

        def stored() -> dict[str, list[dict[str, Any]]]:
            rows = f.query(f"SELECT request_id, {cols} FROM request_records WHERE request_id LIKE 'split-%'")
            out: dict[str, list[dict[str, Any]]] = {}
            for row in rows:
                out.setdefault(str(row[0]), []).append(dict(zip(RECORD_COLUMNS, row[1:], strict=True)))
            return out

        want = {rid: _expected(spans, slo) for rid, _, spans in traces}

        def complete(got: dict[str, list[dict[str, Any]]]) -> bool:
            return set(got) == set(rids) and all(
                len(got[r]) == 1
                and got[r][0]["completion_tokens"] == want[r]["completion_tokens"]
                and got[r][0]["d_decode_s"] is not None
                and got[r][0]["p_queue_s"] is not None
                for r in rids
            )

        try:
            got = wait_until(
                "every split request's record, merged from both halves", stored, done=complete, timeout_s=20
            )
        except AssertionError:
            got = stored()
        wrong = {}
        for rid in rids:
            rows = got.get(rid, [])
            if len(rows) != 1:
                wrong[rid] = f"{len(rows)} records"
                continue
            diff = {
                c: (rows[0][c], want[rid][c]) for c in RECORD_COLUMNS if not _same(rows[0][c], want[rid][c])
            }
            if diff:
                wrong[rid] = diff
        assert not wrong, (
            f"{len(wrong)} of {len(rids)} split requests are wrong (column: (stored, expected)), e.g. "
            f"{dict(list(wrong.items())[:3])}"
        )
        spans_stored = f.query("SELECT count(*) FROM spans WHERE attributes::text LIKE '%split-%'")
        assert spans_stored[0][0] >= len(rids), spans_stored


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and abs(float(a) - float(b)) <= 1e-6 * max(1.0, abs(float(b)))
    return bool(a == b)


# -- e. PostgreSQL restarted under load ---------------------------------------------------


def store_errors(f: Fleet) -> dict[str, int]:
    """Failures each controller (failed ticks or standby reloads, /healthz) and collector (failed store
    writes, ``pdscope_collector_store_errors``) has counted: what rises while the store is down."""
    out = {}
    for c in f.controllers:
        out[c.name] = int(c.health()["failed_ticks"])
    for c in f.collectors:
        out[c.name] = int(sum(c.metrics().get("pdscope_collector_store_errors_total", {}).values()))
    return out


def test_the_fleet_serves_through_a_postgresql_restart_and_every_service_reconnects(
    private_pg: PrivatePg, tmp_path: Path
) -> None:
    import psycopg

    admin = private_pg.start()
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute('CREATE DATABASE "fleet"')
    store = f"{admin.rsplit('/', 1)[0]}/fleet"
    with (
        Fleet(SHAPE, store, tmp_path / "fleet") as f,
        Load(f.proxy_urls, rate=10, max_requests=400, duration_s=30) as load,
    ):
        wait_until(
            "load through every proxy",
            lambda: {r.proxy for r in load.results if r.ok},
            done=lambda s: len(s) == 3,
        )
        t_down = time.time()
        m_down = time.monotonic()
        before = store_errors(f)
        private_pg.stop()
        seen = wait_until(
            "the controllers and collectors to see the store fail",
            lambda: store_errors(f),
            done=lambda now: all(now[k] > before[k] for k in now),
            timeout_s=30,
            ignore=HTTP_ERRORS,
        )
        print(f"store errors seen (before -> during the outage): {before} -> {seen}")
        for c in f.collectors:  # and their /healthz says so (still 200: a restart would not help)
            wait_until(
                f"{c.name}'s /healthz to say the store is failing",
                lambda c=c: c.get("/healthz"),
                done=lambda r: r.status_code == 200 and r.json()["store"]["state"] == "failing",
                timeout_s=30,
                ignore=HTTP_ERRORS,
            )
        down_s = time.time() - t_down
        private_pg.start()
        t_up = time.time()
        m_up = time.monotonic()
        leader = wait_until(
            "a leader to tick again after the restart",
            lambda: [(c, c.health()) for c in f.controllers],
            done=lambda hs: any(h["role"] == "leader" and (h["last_success"] or 0) > t_up for _, h in hs),
            timeout_s=60,
            ignore=HTTP_ERRORS,
        )
        print(f"store down {down_s:.1f}s; a leader ticked again {time.time() - t_up:.1f}s after the restart")
        wait_until(
            "the collectors to write snapshots again",
            lambda: newest_snapshots(f),
            done=lambda n: set(n) == set(f.instances) and min(n.values()) > t_up,
            timeout_s=60,
            ignore=(*HTTP_ERRORS, SQLAlchemyError),
        )
        for s in (*f.collectors, *f.controllers):
            wait_until(
                f"{s.name}'s /healthz to recover",
                lambda s=s: s.get("/healthz").status_code,
                done=lambda c: c == 200,
                timeout_s=60,
                ignore=HTTP_ERRORS,
            )
        for c in f.collectors:
            wait_until(
                f"{c.name}'s /healthz to say the store is back",
                lambda c=c: c.get("/healthz").json(),
                done=lambda h: h["store"]["state"] == "ok" and h["status"] == "ok",
                timeout_s=60,
                ignore=(*HTTP_ERRORS, ValueError),
            )
        assert any(h["role"] == "leader" for _, h in leader)
        wait_until(
            "requests answered after the restart",
            lambda: [r for r in load.sent_since(m_up) if r.ok],
            done=lambda rs: len(rs) >= 20,
            timeout_s=20,
        )
        load.stop()
    failed = [r for r in load.results if not r.ok]
    assert not failed, f"client requests failed across the PostgreSQL restart: {summarize(load.results)}"
    during = [r for r in load.results if m_down <= r.sent <= m_up]
    assert len(during) >= 3, (
        f"too few requests sent while the store was down to show anything: {summarize(during)}"
    )
    newest = f.query("SELECT max(proxy_in) FROM request_records")[0][0]
    assert newest is not None and newest > t_up, "no request record stored after the restart"


# -- f. one proxy killed under load -------------------------------------------------------


def test_the_other_proxies_keep_serving_when_one_is_killed(fleet: Fleet) -> None:
    f = fleet
    victim = f.proxies[2]
    with Load(f.proxy_urls, rate=20, max_requests=300, duration_s=12) as load:
        wait_until(
            "load through every proxy",
            lambda: {r.proxy for r in load.results if r.ok},
            done=lambda s: len(s) == 3,
        )
        t_kill = time.monotonic()
        victim.kill9()
        load.exclude(victim.url)  # the load balancer's health check takes it out
        t_out = time.monotonic()
        wait_until(
            "requests through the others after the kill",
            lambda: [r for r in load.sent_since(t_out) if r.ok],
            done=lambda rs: len(rs) >= 40,
            timeout_s=20,
        )
        load.stop()
    results = load.results
    others = [r for r in results if r.proxy != victim.url]
    assert others and all(r.ok for r in others), f"the surviving proxies failed requests: {summarize(others)}"
    lost = [r for r in results if not r.ok]
    assert all(r.proxy == victim.url and r.sent <= t_out for r in lost), (
        "failures not explained by the kill (only requests in flight at the killed proxy may fail): "
        + summarize(lost)
    )
    assert all(r.sent < t_kill or r.proxy != victim.url for r in results if r.sent > t_out)
    for p in f.proxies[:2]:
        assert p.health()["status"] == "ok"


# -- g. the pools' in-flight sum under a burst through every proxy --------------------------


# each pool's max_inflight_requests: the bench's (at 24 one request is 4% of it, and the 10% target
# becomes a two-request one)
BURST_LIMIT = 48
BURST_SHAPE = FleetShape(
    max_inflight_requests=BURST_LIMIT,
    queue_timeout_s=0.5,
    routing_poll_s=0.25,
    controller={"proxy_ttl_s": 1.0, "proxy_share_floor": 0.2, "proxy_share_window_s": 5.0},
    simulator={"step_overhead_s": 0.08, "decode_per_seq_s": 0.002},  # ~1.5 s a request, little CPU
)


def proxy_shares(f: Fleet, leader: Service) -> dict[str, Any]:
    """``GET /v1/proxies`` on the controller, keyed by proxy id (a list, or {"proxies": [...]})."""
    doc = leader.get("/v1/proxies").json()
    rows = doc.get("proxies", doc) if isinstance(doc, dict) else doc
    return {str(p["id"]): p for p in rows}


def limit_sum(proxies: list[Service], kind: str = "requests") -> dict[str, float]:
    """Each pool's request limit summed over the proxies (``pdscope_proxy_pool_limit{pool,kind}``)."""
    out: dict[str, float] = {}
    for p in proxies:
        for labels, v in p.metrics().get("pdscope_proxy_pool_limit", {}).items():
            d = dict(labels)
            if d.get("kind") in (kind, f"max_inflight_{kind}"):
                out[d["pool"]] = out.get(d["pool"], 0.0) + v
    return out


def test_the_in_flight_sum_across_proxies_stays_within_the_pool_limit_under_a_burst(
    fleet_store: str, tmp_path: Path
) -> None:
    """A burst at ~1.5x the pools' limit, round-robin through 3 proxies: the sum of what the proxies
    hold in flight per pool stays within 10% of the limit (each proxy holds its share, not the whole);
    a killed proxy's share goes to the others within controller.proxy_ttl_s and a poll."""
    with Fleet(BURST_SHAPE, fleet_store, tmp_path / "fleet") as f:
        leader = f.wait_for_leader()
        ids = {p.name for p in f.proxies}
        wait_until(
            "the controller to list every proxy live with a share",
            lambda: proxy_shares(f, leader),
            done=lambda ps: {i for i, p in ps.items() if p.get("live")} == ids,
            timeout_s=20,
            ignore=(*HTTP_ERRORS, KeyError, TypeError),
        )
        # e2e ~1.5 s: 1.5 x 48 in flight needs ~50 req/s offered
        with (
            InflightSampler(f.proxies) as sampler,
            Load(f.proxy_urls, rate=50, max_requests=600, duration_s=10, max_tokens=16, seed=7) as load,
        ):
            pass
        results = load.results
        over_limit = sum(1 for r in results if r.status == 429)
        peaks = {pool: sampler.peak(pool) for pool in ("prefill", "decode")}
        print(
            f"burst: {summarize(results)}; peak in-flight sums {peaks}; limit {BURST_LIMIT}; at the peak "
            f"(sum, each proxy's, each proxy's limit): {sampler.at_peak('decode')}; the proxies' limits "
            f"summed at most {sampler.limit_sum_peak('decode')}"
        )
        assert over_limit > 0 or peaks["decode"] >= BURST_LIMIT * 0.9, (
            f"the burst never reached the limit (peaks {peaks}, no 429): the test proves nothing"
        )
        for pool, peak in peaks.items():
            assert peak <= BURST_LIMIT * 1.1, (
                f"pool {pool}: {peak:g} requests in flight across the proxies, over the limit "
                f"{BURST_LIMIT} by more than 10%"
            )

        victim = f.proxies[2]
        rest = f.proxies[:2]
        t_kill = time.monotonic()
        victim.kill9()
        ttl = BURST_SHAPE.controller["proxy_ttl_s"]
        wait_until(
            f"the controller to count {victim.name} dead",
            lambda: proxy_shares(f, leader),
            done=lambda ps: not ps.get(victim.name, {}).get("live", False),
            timeout_s=ttl + 20,
            every_s=0.05,
            ignore=HTTP_ERRORS,
        )
        moved = wait_until(
            "the survivors' limits to add up to the pools' whole limit again",
            lambda: limit_sum(rest),
            done=lambda s: bool(s) and all(v >= BURST_LIMIT * 0.95 for v in s.values()),
            timeout_s=ttl + 20,
            every_s=0.05,
            ignore=HTTP_ERRORS,
        )
        moved_s = time.monotonic() - t_kill
        bound = ttl + 2 * BURST_SHAPE.routing_poll_s + 1.0
        print(f"a dead proxy's share moved in {moved_s:.2f}s (ttl {ttl:g}s + a poll): {moved}")
        assert moved_s <= bound, f"the dead proxy's share took {moved_s:.2f}s to move (bound {bound:g}s)"
        assert all(v <= BURST_LIMIT * 1.1 for v in moved.values()), moved
