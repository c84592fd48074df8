"""Several proxies polling the controller: each gets its part of the pools' limits; GET /v1/proxies.

Runs on SQLite and on PostgreSQL (the ``store_url`` fixture): the part is worked out from the
``proxies`` table, which every controller replica writes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from controller.api import create_app
from pdscope.routing import ProxyReport
from tests.controller.conftest import World

LIMIT = 256  # the settings' proxy.admission.max_inflight_requests (no pool limit in the table)


@pytest.fixture
def client(world: World) -> Iterator[TestClient]:
    world.step()
    app = create_app(world.reconciler, token="t", notifier=world.notifier)
    # these tests are about the split among several proxies: seats for them (without proxy
    # credentials there are proxy.expected_replicas seats, 1 here: test_proxy_reports.py)
    app.state.proxies.max_proxies = 16
    with TestClient(app) as c:
        yield c


def poll(
    c: TestClient, pid: str, *, demand: int = 0, boot: str = "b0", started: float = 1.0, **kw: Any
) -> Any:
    report = ProxyReport(pid, boot, started, 3, {"prefill": demand, "decode": demand}, {"prefill": 1})
    r = c.get("/v1/routing", params=report.params(), **kw)
    return r


def parts(body: dict[str, Any], pool: str = "prefill") -> int:
    n: int = body["proxy"]["pools"][pool]["max_inflight_requests"]
    return n


def test_a_poll_without_a_report_gets_the_table_without_a_part(client: TestClient) -> None:
    body = client.get("/v1/routing").json()
    assert body["proxy"] is None


def test_three_proxies_split_each_pools_limit_exactly(client: TestClient, world: World) -> None:
    ids = ["p-a:8000", "p-b:8000", "p-c:8000"]
    for pid in ids:
        assert poll(client, pid).status_code == 200
    # a second round: every proxy sees the same live set
    got = {pid: poll(client, pid).json() for pid in ids}
    assert {b["proxy"]["live"] for b in got.values()} == {3}
    for pool in ("prefill", "decode"):
        assert sum(parts(b, pool) for b in got.values()) == LIMIT
        kv = sum(b["proxy"]["pools"][pool]["max_inflight_kv_bytes"] for b in got.values())
        assert kv == world.settings.proxy.admission.max_inflight_kv_bytes
    listing = client.get("/v1/proxies").json()
    assert [p["id"] for p in listing] == ids and all(p["live"] for p in listing)
    assert listing[0]["applied_version"] == 3 and listing[0]["inflight"] == {"prefill": 1}
    assert listing[0]["pools"]["prefill"]["max_inflight_requests"] == parts(got[ids[0]])
    metrics = client.get("/metrics").text
    assert 'pdscope_controller_proxy_polls_total{outcome="new"} 3.0' in metrics
    assert "pdscope_controller_live_proxies 3.0" in metrics


def test_parts_follow_demand_with_a_floor_for_the_idle(client: TestClient, world: World) -> None:
    busy, idle = "busy:1", "idle:1"
    poll(client, busy)
    poll(client, idle)
    total = 0
    for _ in range(60):  # 60 s: the busy proxy sees 20 req/s, the idle one none
        world.clock.advance(1.0)
        total += 20
        b = poll(client, busy, demand=total).json()
        i = poll(client, idle, demand=0).json()
    floor = world.settings.controller.proxy_share_floor
    assert b["proxy"]["pools"]["prefill"]["share"] > 0.8
    assert i["proxy"]["pools"]["prefill"]["share"] >= floor / 2 - 1e-6
    assert parts(i) >= 1 and parts(b) + parts(i) == LIMIT
    listing = {p["id"]: p for p in client.get("/v1/proxies").json()}
    assert listing[busy]["demand_per_s"]["prefill"] > 10 and listing[idle]["demand_per_s"]["prefill"] < 1


def test_a_new_proxy_starts_at_its_peers_mean_and_a_dead_one_leaves(client: TestClient, world: World) -> None:
    poll(client, "a:1")
    poll(client, "b:1")
    total = 0
    for _ in range(30):
        world.clock.advance(1.0)
        total += 10
        poll(client, "a:1", demand=total)
        poll(client, "b:1", demand=total)
    new = poll(client, "c:1").json()  # a and b hold the whole limit: no room yet
    assert new["proxy"]["live"] == 3 and parts(new) == 0
    a, b = poll(client, "a:1", demand=total).json(), poll(client, "b:1", demand=total).json()
    assert parts(a) + parts(b) <= LIMIT * 2 / 3 + 2  # they shrink to their thirds at their next polls
    new = poll(client, "c:1").json()  # no history: the mean of a and b, so a third, now there is room
    assert abs(parts(new) - LIMIT / 3) <= 2
    assert parts(a) + parts(b) + parts(new) <= LIMIT
    # c dies: after proxy_ttl_s, a and b split the whole limit again
    for _ in range(int(world.settings.controller.proxy_ttl_s) + 1):
        world.clock.advance(1.0)
        a = poll(client, "a:1", demand=total).json()
        b = poll(client, "b:1", demand=total).json()
    assert a["proxy"]["live"] == b["proxy"]["live"] == 2
    # each part is worked out at its own poll, from rates a poll apart: never over the limit
    assert LIMIT * 0.98 <= parts(a) + parts(b) <= LIMIT
    listing = {p["id"]: p["live"] for p in client.get("/v1/proxies").json()}
    assert listing == {"a:1": True, "b:1": True, "c:1": False}
    assert "pdscope_controller_proxies_departed_total 1.0" in client.get("/metrics").text


def test_the_etag_carries_the_part(client: TestClient, world: World) -> None:
    first = poll(client, "a:1")
    etag = first.headers["etag"]
    assert poll(client, "a:1", headers={"If-None-Match": etag}).status_code == 304  # same part
    poll(client, "b:1")  # a second proxy: a's part halves
    again = poll(client, "a:1", headers={"If-None-Match": etag})
    assert again.status_code == 200 and parts(again.json()) == LIMIT // 2


def test_a_restart_takes_the_id_over_once_the_holder_is_silent(client: TestClient, world: World) -> None:
    assert poll(client, "a:1", boot="aaaa", started=100.0).status_code == 200
    # the same id from another process while the holder polls: the table, no part, and why
    dup = poll(client, "a:1", boot="bbbb", started=200.0)
    assert dup.status_code == 200 and dup.json()["proxy"] is None
    assert "proxy id 'a:1' is held by another live process" in dup.json()["proxy_withheld"]
    # the holder stops (a restart): past proxy_ttl_s the new process takes the id over
    world.clock.advance(world.settings.controller.proxy_ttl_s + 0.1)
    new = poll(client, "a:1", boot="bbbb", started=200.0)
    assert new.status_code == 200 and parts(new.json()) == LIMIT and new.json()["proxy_withheld"] is None
    row = client.get("/v1/proxies").json()[0]
    assert row["duplicates"] == 1 and row["started"] == 200.0
    metrics = client.get("/metrics").text
    assert 'outcome="duplicate_id"} 1.0' in metrics and 'outcome="restarted"} 1.0' in metrics


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"proxy": "-bad"}, "proxy"),
        ({"proxy": "a" * 129}, "proxy"),
        ({"proxy": "a:1", "boot": "XYZ", "started": "1"}, "boot"),
        ({"proxy": "a:1", "boot": "ab", "started": "inf"}, "started"),
        ({"proxy": "a:1", "boot": "ab", "started": "1", "applied": "-3"}, "applied"),
        ({"proxy": "a:1", "boot": "ab", "started": "1", "demand": "prefill=3"}, "demand"),
        ({"proxy": "a:1", "boot": "ab", "started": "1", "demand": "prefill:1,prefill:2"}, "demand"),
        ({"proxy": "a:1", "boot": "ab", "started": "1", "inflight": "p:" + "9" * 30}, "inflight"),
        (
            {"proxy": "a:1", "boot": "ab", "started": "1", "demand": ",".join(f"p{i}:1" for i in range(65))},
            "demand",
        ),
    ],
)
def test_a_bad_report_is_a_400_naming_the_parameter(
    client: TestClient, params: dict[str, str], field: str
) -> None:
    r = client.get("/v1/routing", params=params)
    assert r.status_code == 400, r.text
    assert r.json()["detail"][0]["field"] == field
    assert client.get("/v1/proxies").json() == []  # nothing recorded
    assert 'pdscope_controller_proxy_polls_total{outcome="bad_report"} 1.0' in client.get("/metrics").text


def test_a_store_failure_serves_the_table_without_a_part(client: TestClient, world: World) -> None:
    poll(client, "a:1")
    world.reconciler.factory.kw["bind"].dispose()
    bind = world.reconciler.factory.kw["bind"]
    world.reconciler.factory.configure(bind=None)
    try:
        r = poll(client, "a:1")
    finally:
        world.reconciler.factory.configure(bind=bind)
    assert r.status_code == 200 and r.json()["proxy"] is None
    assert 'outcome="store_error"} 1.0' in client.get("/metrics").text


def test_with_proxy_tokens_a_report_needs_one(world: World) -> None:
    world.step()
    app = create_app(world.reconciler, token="t", notifier=world.notifier, proxy_tokens={"tok-1": "a"})
    with TestClient(app) as c:
        assert c.get("/v1/routing").status_code == 200  # a poll without a report stays open
        r = poll(c, "a:1")
        assert r.status_code == 401 and "PDSCOPE_PROXY_TOKENS" in r.json()["detail"]
        assert poll(c, "a:1", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/v1/proxies").json() == []  # nothing recorded
        ok = poll(c, "a:1", headers={"Authorization": "Bearer tok-1"})
        assert ok.status_code == 200 and parts(ok.json()) == LIMIT
        assert 'outcome="unauthenticated"} 2.0' in c.get("/metrics").text


def test_a_new_proxy_past_max_proxies_gets_no_part(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    world.step()
    app = create_app(world.reconciler, token="t", notifier=world.notifier)
    with TestClient(app) as c:
        registry = app.state.proxies
        monkeypatch.setattr(registry, "max_proxies", 2)
        assert poll(c, "a:1").json()["proxy"] is not None and poll(c, "b:1").json()["proxy"] is not None
        third = poll(c, "c:1")
        assert third.status_code == 200 and third.json()["proxy"] is None
        assert {p["id"] for p in c.get("/v1/proxies").json()} == {"a:1", "b:1"}
        assert 'outcome="over_limit"} 1.0' in c.get("/metrics").text
        assert poll(c, "a:1").json()["proxy"]["live"] == 2


def test_granted_parts_never_add_up_past_the_limit(client: TestClient, world: World) -> None:
    """Polls in any order, demand shifting between proxies, one joining and one dying: at every
    moment the parts the live proxies hold add up to the limit at most."""
    import random

    rng = random.Random(7)
    ids = ["a:1", "b:1", "c:1"]
    totals = dict.fromkeys(ids, 0)
    for step in range(150):
        world.clock.advance(0.3)
        live = ids if step < 100 else ids[:2]  # c dies at step 100
        if step == 40:
            live = [*ids, "d:1"]
            ids.append("d:1")
            totals["d:1"] = 0
        pid = rng.choice(live)
        totals[pid] += rng.choice([0, 1, 5, 30]) if pid != "a:1" or step < 70 else 60  # a's demand jumps
        poll(client, pid, demand=totals[pid])
        held = [
            p["pools"]["prefill"]["max_inflight_requests"]
            for p in client.get("/v1/proxies").json()
            if p["live"]
        ]
        assert sum(held) <= LIMIT, (step, held)
    assert sum(held) >= LIMIT * 0.9  # and most of the limit is in use


def test_a_proxy_still_over_its_part_keeps_the_others_room_down(client: TestClient) -> None:
    poll(client, "a:1")  # alone: the whole limit, and it fills it
    poll(client, "b:1")  # no room yet
    r = client.get(
        "/v1/routing",
        params=ProxyReport("a:1", "b0", 1.0, 3, {"prefill": 0}, {"prefill": 200}).params(),
    )
    assert parts(r.json()) == LIMIT // 2  # a's part halves, but 200 are still in flight there
    b = poll(client, "b:1").json()
    assert parts(b) == LIMIT - 200  # b gets the room a's in-flight leaves, not its half
