"""The control API: auth, validation, TTL expiry, audit, ETag, reads."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from controller.api import create_app
from controller.cli import check_listen
from pdscope.config import is_loopback
from store.db import transaction
from store.models import AuditEvent, WeightOverride
from tests.controller.conftest import World

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}", "X-Actor": "alice"}


@pytest.fixture
def client(world: World) -> Iterator[TestClient]:
    world.step()
    app = create_app(world.reconciler, token=TOKEN, notifier=world.notifier)
    with TestClient(app) as c:
        yield c


def counts(world: World) -> tuple[int, int]:
    with transaction(world.factory) as s:
        return (
            s.scalar(select(func.count()).select_from(WeightOverride)) or 0,
            s.scalar(select(func.count()).select_from(AuditEvent)) or 0,
        )


# -- routing and ETag ----------------------------------------------------------------------


def test_routing_etag_and_304(client: TestClient, world: World) -> None:
    r = client.get("/v1/routing")
    assert r.status_code == 200
    etag = r.headers["etag"]
    body = r.json()
    # the process's epoch and the version, then the served rates' digest (fitted from the seeded records)
    assert etag.startswith(f'"{world.reconciler.epoch}-{body["version"]}-r') and body["mode"] == "enforce"
    assert body["enforce"] is True
    assert {i["name"] for i in body["instances"]} == {
        "prefill-0",
        "prefill-1",
        "decode-0",
        "decode-1",
        "decode-2",
        "decode-3",
    }
    assert client.get("/v1/routing", headers={"If-None-Match": etag}).status_code == 304
    assert client.get("/v1/routing", headers={"If-None-Match": f"W/{etag}"}).status_code == 304
    world.step()  # nothing changed: same version
    assert client.get("/v1/routing", headers={"If-None-Match": etag}).status_code == 304
    client.put(
        "/v1/instances/decode-1/weight", json={"weight": 0.5, "ttl_s": 60, "reason": "x"}, headers=AUTH
    )
    r2 = client.get("/v1/routing", headers={"If-None-Match": etag})
    assert r2.status_code == 200 and r2.headers["etag"] != etag
    assert next(i for i in r2.json()["instances"] if i["name"] == "decode-1")["weight"] == 0.5


# -- auth -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers,status",
    [
        ({}, 401),
        ({"Authorization": "Bearer wrong"}, 401),
        ({"Authorization": f"Basic {TOKEN}"}, 401),
        ({"Authorization": "Bearer"}, 401),
    ],
)
def test_mutations_need_the_token(
    client: TestClient, world: World, headers: dict[str, str], status: int
) -> None:
    body = {"weight": 0.5, "ttl_s": 60, "reason": "x"}
    assert client.put("/v1/instances/decode-1/weight", json=body, headers=headers).status_code == status
    assert (
        client.post("/v1/instances/decode-1/drain", json={"reason": "x"}, headers=headers).status_code
        == status
    )
    assert client.put("/v1/pools/decode/weight", json=body, headers=headers).status_code == status
    assert counts(world) == (0, 0)


def test_no_token_configured_disables_mutations(world: World) -> None:
    world.step()
    with TestClient(create_app(world.reconciler, token=None)) as c:
        r = c.post("/v1/instances/decode-1/drain", json={"reason": "x"}, headers=AUTH)
        assert r.status_code == 403 and "PDSCOPE_API_TOKEN" in r.json()["detail"]
        assert c.get("/v1/routing").status_code == 200


def test_reads_are_open(client: TestClient) -> None:
    for path in (
        "/v1/routing",
        "/v1/pools",
        "/v1/instances/decode-0/weight",
        "/v1/decisions",
        "/v1/alerts",
        "/v1/slo",
        "/healthz",
        "/metrics",
        "/openapi.json",
    ):
        assert client.get(path).status_code == 200, path


# -- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body,field",
    [
        ({"weight": -1, "ttl_s": 60, "reason": "x"}, "weight"),
        ({"weight": 101, "ttl_s": 60, "reason": "x"}, "weight"),
        ({"weight": "heavy", "ttl_s": 60, "reason": "x"}, "weight"),
        ({"weight": 0.5, "reason": "x"}, "ttl_s"),
        ({"weight": 0.5, "ttl_s": 0, "reason": "x"}, "ttl_s"),
        ({"weight": 0.5, "ttl_s": 10 * 86400, "reason": "x"}, "ttl_s"),
        ({"weight": 0.5, "ttl_s": 60, "reason": ""}, "reason"),
        ({"weight": 0.5, "ttl_s": 60}, "reason"),
        ({"weight": 0.5, "ttl_s": 60, "reason": "x", "wieght": 1}, "wieght"),
    ],
)
def test_bad_input_names_the_field_and_writes_nothing(
    client: TestClient, world: World, body: dict[str, object], field: str
) -> None:
    before = client.get("/v1/routing").json()
    r = client.put("/v1/instances/decode-1/weight", json=body, headers=AUTH)
    assert r.status_code == 422
    problems = r.json()["detail"]
    assert any(p["field"] == field and p["reason"] for p in problems), problems
    assert counts(world) == (0, 0)
    assert client.get("/v1/routing").json() == before


def test_non_json_body_is_422(client: TestClient) -> None:
    r = client.put("/v1/instances/decode-1/weight", content=b"weight=1", headers=AUTH)
    assert r.status_code == 422


def test_unknown_names_are_404(client: TestClient, world: World) -> None:
    body = {"weight": 0.5, "ttl_s": 60, "reason": "x"}
    r = client.put("/v1/instances/decode-9/weight", json=body, headers=AUTH)
    assert r.status_code == 404 and "decode-9" in r.json()["detail"]
    assert client.put("/v1/pools/nope/weight", json=body, headers=AUTH).status_code == 404
    assert client.get("/v1/instances/nope/weight").status_code == 404
    assert counts(world) == (0, 0)


def test_undrain_without_a_drain_is_409_and_writes_nothing(client: TestClient, world: World) -> None:
    r = client.post("/v1/instances/decode-1/undrain", json={"reason": "x"}, headers=AUTH)
    assert r.status_code == 409 and "no active drain" in r.json()["detail"]
    assert counts(world) == (0, 0)


def test_query_validation(client: TestClient) -> None:
    r = client.get("/v1/decisions", params={"limit": 0})
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "limit"
    assert client.get("/v1/alerts", params={"state": "burning"}).status_code == 422


# -- overrides, TTL, audit -----------------------------------------------------------------


def test_weight_override_wins_until_ttl_and_is_audited(client: TestClient, world: World) -> None:
    r = client.put(
        "/v1/instances/decode-1/weight", json={"weight": 0.25, "ttl_s": 5, "reason": "slow NIC"}, headers=AUTH
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["weight"] == 0.25 and out["source"] == "override" and out["policy_weight"] == 1.0
    assert out["override"]["reason"] == "slow NIC" and out["override"]["actor"] == "api:alice"
    with transaction(world.factory) as s:
        ev = s.scalars(select(AuditEvent)).one()
        assert ev.action == "weight.set" and ev.subject == "decode-1" and ev.actor == "api:alice"
        assert ev.before == {
            "weight": 1.0,
            "drained": False,
            "source": "policy",
            "policy_weight": 1.0,
            "override_id": None,
        }
        assert ev.after is not None and ev.after["weight"] == 0.25 and ev.after["source"] == "override"
        assert ev.reason == "slow NIC" and ev.override_id == out["override"]["id"] == ev.after["override_id"]
        assert ev.id == out["audit_id"]
    world.step()
    assert world.weight("decode-1") == 0.25
    world.step()
    world.step()  # 6 s later: the TTL has passed
    assert world.weight("decode-1") == 1.0
    got = client.get("/v1/instances/decode-1/weight").json()
    assert got["source"] == "policy" and got["override"] is None
    ended = client.get("/v1/decisions", params={"subject": "decode-1", "field": "served_weight"}).json()
    assert ended[0]["reason"] == "OverrideEnded"


def test_a_new_weight_override_replaces_the_old(client: TestClient, world: World) -> None:
    client.put(
        "/v1/instances/decode-1/weight", json={"weight": 0.25, "ttl_s": 60, "reason": "a"}, headers=AUTH
    )
    client.put(
        "/v1/instances/decode-1/weight", json={"weight": 0.75, "ttl_s": 60, "reason": "b"}, headers=AUTH
    )
    with transaction(world.factory) as s:
        rows = s.scalars(select(WeightOverride).order_by(WeightOverride.id)).all()
        assert rows[0].cleared is not None and rows[1].cleared is None
        evs = s.scalars(select(AuditEvent).order_by(AuditEvent.id)).all()
        assert evs[1].before is not None and evs[1].before["weight"] == 0.25
    assert world.weight("decode-1") == 0.75
    r = client.request("DELETE", "/v1/instances/decode-1/weight", json={"reason": "done"}, headers=AUTH)
    assert r.status_code == 200 and r.json()["source"] == "policy"
    assert world.weight("decode-1") == 1.0


def test_drain_and_undrain(client: TestClient, world: World) -> None:
    r = client.post("/v1/instances/decode-3/drain", json={"reason": "maintenance"}, headers=AUTH)
    assert r.status_code == 200 and r.json()["drained"] is True and r.json()["weight"] == 0.0
    route = next(i for i in client.get("/v1/routing").json()["instances"] if i["name"] == "decode-3")
    assert route["weight"] == 0.0 and route["drained"] is True and route["reason"] == "Drained"
    for _ in range(3):
        world.step()
    assert world.weight("decode-3") == 0.0, "a drain outlives ticks"
    r = client.post("/v1/instances/decode-3/undrain", json={"reason": "back"}, headers=AUTH)
    assert r.status_code == 200 and r.json()["drained"] is False and r.json()["weight"] == 1.0
    with transaction(world.factory) as s:
        actions = [e.action for e in s.scalars(select(AuditEvent).order_by(AuditEvent.id))]
        assert actions == ["drain", "undrain"]


def test_drain_with_ttl_ends_by_itself(client: TestClient, world: World) -> None:
    client.post("/v1/instances/prefill-0/drain", json={"reason": "x", "ttl_s": 3}, headers=AUTH)
    assert world.weight("prefill-0") == 0.0
    world.step()
    world.step()
    assert world.weight("prefill-0") == 1.0


def test_pool_weight(client: TestClient, world: World) -> None:
    r = client.put(
        "/v1/pools/decode/weight", json={"weight": 0.5, "ttl_s": 60, "reason": "half"}, headers=AUTH
    )
    assert r.status_code == 200, r.text
    assert r.json()["weight"] == 0.5 and r.json()["override"]["reason"] == "half"
    pools = {p["name"]: p for p in client.get("/v1/routing").json()["pools"]}
    assert pools["decode"]["weight"] == 0.5 and pools["decode"]["reason"] == "ManualOverride"
    with transaction(world.factory) as s:
        ev = s.scalars(select(AuditEvent)).one()
        assert ev.action == "pool_weight.set" and ev.before == {"weight": 1.0, "override_id": None}


# -- reads ------------------------------------------------------------------------------------


def test_pools_decisions_alerts_slo_health_metrics(client: TestClient, world: World) -> None:
    for _ in range(5):
        world.step(handoff_s={"decode-2": 0.5}, scrape={"prefill_0": {"expired": 1.0}})
    pools = client.get("/v1/pools").json()
    dec = next(p for p in pools if p["name"] == "decode")
    assert dec["max_inflight_requests"] is not None and dec["decision"]["arithmetic"]
    d2 = next(i for i in dec["instances"] if i["name"] == "decode-2")
    assert d2["weight"] < 1.0 and d2["decision"]["reason"] in ("SlowHandoff", "SlowKVTransfer")
    decisions = client.get("/v1/decisions", params={"subject": "decode-2"}).json()
    assert decisions and decisions[0]["arithmetic"] and decisions[0]["message"]
    alerts = client.get("/v1/alerts").json()
    assert any(a["rule"] == "KVLeaseExpired" and a["state"] == "firing" for a in alerts)
    slo = client.get("/v1/slo").json()
    assert slo["ttft_target_ms"] == 2000 and slo["completed"] > 0 and slo["attainment"] == 1.0
    h = client.get("/healthz")
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["ticks"] == 6
    m = client.get("/metrics").text
    assert 'pdscope_instance_weight{instance="decode-2"' in m
    assert 'pdscope_alerts{alertname="KVLeaseExpired",alertstate="firing"' in m
    assert "pdscope_controller_ticks_total 6.0" in m
    assert 'pdscope_pool_max_inflight_requests{pool="decode",role="decode"}' in m


def test_every_decision_names_the_policy_config_it_was_taken_under(client: TestClient, world: World) -> None:
    for _ in range(5):
        world.step(handoff_s={"decode-2": 0.5})
    decisions = client.get("/v1/decisions").json()
    now = client.get("/v1/policy").json()
    assert decisions and {d["policy"] for d in decisions} == {now["fingerprint"]}
    assert now["fingerprint"].startswith(f"v{now['version']}:")
    assert now["config"]["min_weight"] == world.settings.controller.min_weight
    stored = client.get(f"/v1/policy/{now['fingerprint']}").json()
    assert stored["config"] == now["config"] and stored["first_seen"] is not None
    assert client.get("/v1/policy/v1:0000").status_code == 404


def test_healthz_degrades_when_ticks_stop(client: TestClient, world: World) -> None:
    world.clock.advance(60)
    r = client.get("/healthz")
    assert r.status_code == 503 and r.json()["status"] == "degraded"


def test_openapi_lists_every_route(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for p in (
        "/v1/routing",
        "/v1/pools",
        "/v1/instances/{name}/weight",
        "/v1/instances/{name}/drain",
        "/v1/instances/{name}/undrain",
        "/v1/pools/{pool}/weight",
        "/v1/decisions",
        "/v1/alerts",
        "/v1/alerts/rules",
        "/v1/slo",
        "/v1/policy",
        "/v1/policy/{fingerprint}",
        "/healthz",
        "/metrics",
    ):
        assert p in paths, p
    assert "put" in paths["/v1/instances/{name}/weight"] and "get" in paths["/v1/instances/{name}/weight"]


def test_store_down_is_503(client: TestClient, world: World) -> None:
    from sqlalchemy import text

    with transaction(world.factory) as s:
        s.execute(text("DROP TABLE decisions"))
    r = client.get("/v1/decisions")
    assert r.status_code == 503 and "store unavailable" in r.json()["detail"]


# -- listening ---------------------------------------------------------------------------------


def test_refuses_non_loopback_without_token() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    assert check_listen("127.0.0.1", None, "T") is None
    assert check_listen("0.0.0.0", "tok", "T") is None
    msg = check_listen("0.0.0.0", None, "PDSCOPE_API_TOKEN")
    assert msg is not None and "$PDSCOPE_API_TOKEN" in msg


def test_cli_refuses_non_loopback_without_token(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    import pathlib

    from pdscope.cli import main

    cfg = pathlib.Path(str(tmp_path)) / "c.yaml"
    cfg.write_text(
        "model: {name: m, kv_bytes_per_token: 1}\npools:\n  p: {role: prefill, instances: "
        "[{name: p0, url: 'http://127.0.0.1:1'}]}\n  d: {role: decode, instances: "
        "[{name: d0, url: 'http://127.0.0.1:2'}]}\n"
    )
    monkeypatch.delenv("PDSCOPE_API_TOKEN", raising=False)
    assert main(["--config", str(cfg), "control", "--host", "0.0.0.0", "--no-migrate"]) == 1
