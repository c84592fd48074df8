"""GET /v1/replay over ticks the reconciler recorded (SQLite and PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from controller.api import create_app
from controller.policy.config import POLICY_VERSION
from store.db import transaction
from store.models import TickRecord
from tests.controller.conftest import World

URL = "/v1/replay"


@pytest.fixture
def client(world: World) -> Iterator[TestClient]:
    app = create_app(world.reconciler, token="t0ken", notifier=world.notifier)
    with TestClient(app) as c:
        yield c


def _slow_d(world: World) -> None:
    for _ in range(3):
        world.step()
    for _ in range(5):
        world.step(handoff_s={"decode-2": 0.5}, scrape={"decode_2": {"xfer_s": 0.1}})


def test_the_stored_config_reproduces_and_a_change_parts(client: TestClient, world: World) -> None:
    _slow_d(world)
    body = client.get(URL, params={"since": "1h"}).json()
    assert body["ticks"] == 8 and body["reproduced"] is True and body["identical"] is True
    assert body["mismatch_count"] == 0 and body["candidate"] is None
    assert "timeline" not in body
    r = client.get(URL, params={"since": "1h", "set": ["max_weight_step=0.05"], "timeline": "true"})
    assert r.status_code == 200, r.text
    cand = r.json()
    assert cand["reproduced"] is True and cand["identical"] is False
    assert cand["candidate"].startswith(f"v{POLICY_VERSION}:") and cand["candidate"] not in cand["policies"]
    first = cand["first_divergence"]
    assert (first["what"], first["subject"]) == ("weight", "decode-2")
    points = cand["timeline"]["decode-2"]
    assert points[0][1] == points[0][2] == 1.0 and any(a != b for _, a, b in points)
    w = cand["weights"]["decode-2"]
    assert w["replayed"]["mean"] > w["actual"]["mean"]


@pytest.mark.parametrize(
    ("params", "status", "field"),
    [
        ({"since": "1h", "set": "min_wieght=0.1"}, 400, "set"),
        ({"since": "1h", "set": "min_weight=-2"}, 400, "set"),
        ({"since": "tomorrow"}, 400, "since"),
        ({"from": 1.0, "until": 0.5}, 400, "from"),
    ],
)
def test_a_bad_parameter_is_a_400_naming_it(
    client: TestClient, world: World, params: dict[str, object], status: int, field: str
) -> None:
    _slow_d(world)
    r = client.get(URL, params=params)  # type: ignore[arg-type]
    assert r.status_code == status, r.text
    assert r.json()["detail"][0]["field"] == field


def test_no_ticks_is_a_404_and_another_version_a_422(client: TestClient, world: World) -> None:
    r = client.get(URL, params={"since": "1h"})
    assert r.status_code == 404 and "no controller tick" in r.json()["detail"][0]["reason"]
    _slow_d(world)
    with transaction(world.factory) as s:
        row = s.scalars(select(TickRecord).order_by(TickRecord.id.desc())).first()
        assert row is not None
        row.policy_version = 99
    r = client.get(URL, params={"since": "1h"})
    assert r.status_code == 422
    assert "policy version 99" in r.json()["detail"][0]["reason"]


def test_the_route_is_an_open_read_in_the_openapi_document(client: TestClient, world: World) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert {p["name"] for p in paths[URL]["get"]["parameters"]} == {
        "since",
        "from",
        "until",
        "set",
        "timeline",
    }
    _slow_d(world)
    r = client.get(URL, params={"since": "5m"}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 200
