"""GET /v1/slo/attribution over a seeded store: the range parameters, the bound, and what it names."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from analysis.attribution_records import transfer_failed
from controller.api import create_app
from controller.attribution import BadRange, parse_duration, resolve_range
from store.db import transaction
from store.models import RequestRecord
from tests.controller.conftest import World

URL = "/v1/slo/attribution"


@pytest.fixture
def client(world: World) -> Iterator[TestClient]:
    app = create_app(world.reconciler, token="t0ken", notifier=world.notifier)
    with TestClient(app) as c:
        yield c


def steps(world: World, n: int, **kw: Any) -> None:
    for _ in range(n):
        world.step(tick=False, **kw)


def test_a_slow_p_is_the_top_reason(client: TestClient, world: World) -> None:
    steps(world, 5)
    steps(world, 3, prefill_s={"prefill-1": 2.5})
    r = client.get(URL, params={"since": "30m"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["requests"] == 8 * 8 and body["missed"] == 3 * 4 and body["truncated"] is False
    top = body["top"][0]
    assert (top["stage"], top["place"], top["cause"]) == ("prefill", "prefill-1", "slow")
    assert top["count"] == 12 and top["share"] == pytest.approx(1.0)
    assert top["message"].startswith("prefill on prefill-1: 100% of the excess since ")
    assert body["misses_shown"] == 12
    assert body["misses"][0]["stages"][0]["split"] is False  # the seeded records carry no P queue time


def test_expired_leases_name_the_pairs_into_the_stuck_d(client: TestClient, world: World) -> None:
    steps(world, 5)
    steps(world, 2, handoff_s={"decode-2": 3.0}, suspect={"decode-2"})
    body = client.get(URL, params={"since": "1h", "misses": 0}).json()
    groups = {(g["stage"], g["place"], g["cause"]) for g in body["groups"]}
    # the expiries on the handoffs of both P's alike: every link into that D
    assert groups == {("handoff", "*->decode-2", "lease_expired")}
    assert body["misses"] == [] and body["missed"] == 4


def test_from_until_picks_the_range(client: TestClient, world: World) -> None:
    steps(world, 3)
    t_slow = world.clock()
    steps(world, 2, prefill_s={"prefill-0": 2.5})
    t_end = world.clock()
    steps(world, 3)
    before = client.get(URL, params={"from": t_slow - 100, "until": t_slow}).json()
    assert before["missed"] == 0 and before["top"] == [] and before["requests"] > 0
    during = client.get(URL, params={"from": t_slow, "until": t_end}).json()
    assert during["missed"] == 8 and during["top"][0]["place"] == "prefill-0"


def test_no_data_says_so(client: TestClient) -> None:
    body = client.get(URL, params={"since": "30m"}).json()
    assert body["requests"] == 0 and body["groups"] == []
    assert body["summary"] == "no request records in the range"


def test_the_records_read_are_bounded(client: TestClient, world: World) -> None:
    steps(world, 3)
    body = client.get(URL, params={"since": "1h", "limit": 5}).json()
    assert body["requests"] == 5 and body["truncated"] is True and body["record_limit"] == 5


@pytest.mark.parametrize(
    ("params", "status", "field"),
    [
        ({"since": "abc"}, 400, "since"),
        ({"since": "0m"}, 400, "since"),
        ({"since": "30d"}, 400, "since"),
        ({"since": "30m", "from": "1"}, 400, "since"),
        ({}, 400, "since"),
        ({"from": "2000", "until": "1000"}, 400, "from"),
        ({"from": "nan"}, 422, "from"),  # a finite Unix time is a bound of the query parameter
        ({"from": "1", "until": "inf"}, 422, "until"),
        ({"from": "soon"}, 422, "from"),
        ({"since": "30m", "limit": "0"}, 422, "limit"),
        ({"since": "30m", "misses": "5000"}, 422, "misses"),
        ({"since": "1" * 40}, 422, "since"),
    ],
)
def test_bad_parameters_are_named(
    client: TestClient, params: dict[str, str], status: int, field: str
) -> None:
    r = client.get(URL, params=params)
    assert r.status_code == status, r.text
    assert r.json()["detail"][0]["field"] == field


def test_store_down_is_503(client: TestClient, world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    from controller.endpoints import attribution as ep
    from store.db import StoreError

    def down(*a: object, **k: object) -> None:
        raise StoreError("connection refused")

    monkeypatch.setattr(ep, "window_attribution", down)
    assert client.get(URL, params={"since": "30m"}).status_code == 503


def test_a_transfer_failure_during_the_handoff_is_its_cause(client: TestClient, world: World) -> None:
    steps(world, 4)
    steps(world, 2, handoff_s={"decode-1": 3.0})
    with transaction(world.factory) as s:
        s.execute(
            update(RequestRecord)
            .where(RequestRecord.d_instance == "decode-1", RequestRecord.p_instance == "prefill-0")
            .values(attributes={"nixl": {"d": {"instance": "decode-1", "nixl_failed_transfers": 2.0}}})
        )
    groups = {(g["place"], g["cause"]) for g in client.get(URL, params={"since": "1h"}).json()["groups"]}
    assert ("prefill-0->decode-1", "transfer_failed") in groups
    # decode-1 was slow from both Ps: the slow handoffs left, through prefill-1 only, were slow no more
    # often than prefill-0's into it, so they are the D's queue, not that pair's
    assert ("decode-1", "slow") in groups
    assert ("prefill-1->decode-1", "slow") not in groups


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90.0), ("90s", 90.0), ("30m", 1800.0), ("2h", 7200.0), ("1d", 86400.0), ("1.5m", 90.0)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "m", "-5m", "5w", "30 minutes", "8d"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(BadRange) as exc:
        parse_duration(text)
    assert exc.value.param == "since"


def test_resolve_range() -> None:
    assert resolve_range(1000.0, since="10m") == (400.0, 1000.0)
    assert resolve_range(1000.0, since="1m", until=500.0) == (440.0, 500.0)
    assert resolve_range(1000.0, from_=100.0) == (100.0, 1000.0)


@pytest.mark.parametrize(
    ("attributes", "failed"),
    [
        (None, False),
        ({}, False),
        ({"nixl": {"d": {"nixl_failed_transfers": 0}}}, False),
        ({"nixl": {"d": {"nixl_failed_transfers": None}}}, False),
        ({"nixl": {"d": {"nixl_failed_transfers": True}}}, False),
        ({"nixl": {"d": {"nixl_failed_transfers": "3"}}}, False),
        ({"nixl": ["d"]}, False),
        ({"nixl": {"d": {"nixl_failed_transfers": 1.0}}}, True),
    ],
)
def test_transfer_failed_reads_only_a_positive_count(attributes: dict[str, Any] | None, failed: bool) -> None:
    assert transfer_failed(attributes) is failed


def test_the_route_is_an_open_read_in_the_openapi_document(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    params = {p["name"] for p in paths[URL]["get"]["parameters"]}
    assert params == {"since", "from", "until", "misses", "limit"}
    assert (
        client.get(URL, params={"since": "5m"}, headers={"Authorization": "Bearer wrong"}).status_code == 200
    )
