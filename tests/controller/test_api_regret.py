"""GET /v1/decisions/regret over a seeded store: a real cut by the policy and its way back, stored
flapping decisions and the flap horizon, the range parameters."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from controller.api import create_app
from store.db import transaction
from store.models import Decision
from tests.controller.conftest import World

URL = "/v1/decisions/regret"


@pytest.fixture
def client(world: World) -> Iterator[TestClient]:
    app = create_app(world.reconciler, token="t0ken", notifier=world.notifier)
    with TestClient(app) as c:
        yield c


def weight_decisions(world: World, name: str) -> list[Decision]:
    with transaction(world.factory) as s:
        rows = s.scalars(
            select(Decision).where(Decision.subject == name, Decision.field == "weight").order_by(Decision.id)
        ).all()
        s.expunge_all()
        return list(rows)


def test_a_real_cut_recovers_and_is_undone(client: TestClient, world: World) -> None:
    for _ in range(6):
        world.step()
    slow = {"decode-2": 3.0}
    for _ in range(30):  # bounded: the policy cuts a D whose handoffs take 3 s within a few ticks
        world.step(handoff_s=slow)
        if world.weight("decode-2") < 1.0:
            break
    assert world.weight("decode-2") < 1.0
    for _ in range(3):
        world.step(handoff_s=slow)
    for _ in range(400):  # bounded: healthy again, it is raised back to 1 (probes, then recovery)
        world.step()
        if world.weight("decode-2") >= 1.0:
            break
    assert world.weight("decode-2") >= 1.0
    stored = weight_decisions(world, "decode-2")
    cuts = [
        d for d in stored if d.old_value is not None and d.new_value is not None and d.new_value < d.old_value
    ]
    assert cuts
    body = client.get(URL, params={"since": "1h", "flap_ticks": 100_000}).json()
    mine = [c for c in body["cuts"] if c["subject"] == "decode-2"]
    assert [(c["ts"], c["reason"], c["new_value"]) for c in mine] == [
        (d.ts, d.reason, d.new_value) for d in cuts
    ]
    first = mine[0]
    undo = next(
        d for d in stored if d.ts > cuts[0].ts and (d.new_value or 0) >= (cuts[0].old_value or 0) - 1e-9
    )
    assert first["undone_at"] == undo.ts and first["undone_by"] == undo.reason
    assert first["undone_after_ticks"] == undo.tick - cuts[0].tick and first["flapped"] is True
    # its handoffs were back at the peers' within the lookahead; before the heal they were not
    assert first["recovered_at"] is not None and first["recovered_at"] > cuts[0].ts
    # the fleet missed (3 s handoffs) before the first cut; it met everything after the heal
    assert first["slo_before"] < 1.0
    tally = {t["reason"]: t for t in body["reasons"]}
    assert tally[first["reason"]]["cuts"] >= 1 and body["total"]["cuts"] == len(body["cuts"])
    # with a horizon shorter than the way back, the same cut did not flap
    short = client.get(URL, params={"since": "1h", "flap_ticks": 1}).json()
    assert next(c for c in short["cuts"] if c["ts"] == first["ts"])["flapped"] is (
        first["undone_after_ticks"] <= 1
    )


def _store(world: World, rows: list[dict[str, Any]]) -> None:
    with transaction(world.factory) as s:
        for r in rows:
            s.add(
                Decision(
                    mode="enforce",
                    subject_kind=r.get("kind", "instance"),
                    message="",
                    inputs={},
                    scores={},
                    leader_epoch=r.get("epoch", 1),
                    **{k: v for k, v in r.items() if k not in ("kind", "epoch")},
                )
            )


def test_stored_flapping_is_tallied_per_reason(client: TestClient, world: World) -> None:
    t0 = world.clock() - 600.0
    rows = []
    for i in range(3):  # decode-1: SlowKVTransfer cuts, each undone 3 ticks later
        tick = 10 * i
        rows += [
            {
                "ts": t0 + 2 * tick,
                "tick": tick,
                "subject": "decode-1",
                "field": "weight",
                "old_value": 1.0,
                "new_value": 0.4,
                "reason": "SlowKVTransfer",
            },
            {
                "ts": t0 + 2 * (tick + 3),
                "tick": tick + 3,
                "subject": "decode-1",
                "field": "weight",
                "old_value": 0.4,
                "new_value": 1.0,
                "reason": "Recovering",
            },
        ]
    rows += [  # a pool's limit cut, never undone; its other limit fields are not counted again
        {
            "ts": t0 + 100,
            "tick": 50,
            "kind": "pool",
            "subject": "decode",
            "field": "max_inflight_requests",
            "old_value": 256.0,
            "new_value": 128.0,
            "reason": "HandoffBacklog",
        },
        {
            "ts": t0 + 100,
            "tick": 50,
            "kind": "pool",
            "subject": "decode",
            "field": "max_inflight_kv_bytes",
            "old_value": 64.0,
            "new_value": 32.0,
            "reason": "HandoffBacklog",
        },
        # an operator's served weight is not the policy's
        {
            "ts": t0 + 100,
            "tick": 50,
            "subject": "decode-0",
            "field": "served_weight",
            "old_value": 1.0,
            "new_value": 0.2,
            "reason": "ManualOverride",
        },
    ]
    _store(world, rows)
    body = client.get(URL, params={"since": "1h", "flap_ticks": 3}).json()
    tally = {t["reason"]: t for t in body["reasons"]}
    assert set(tally) == {"SlowKVTransfer", "HandoffBacklog"}
    kv = tally["SlowKVTransfer"]
    assert (kv["cuts"], kv["undone"], kv["flapped"], kv["flap_rate"], kv["median_ticks_to_undo"]) == (
        3,
        3,
        3,
        1.0,
        3,
    )
    assert kv["median_s_to_undo"] == 6.0
    backlog = tally["HandoffBacklog"]
    assert (backlog["cuts"], backlog["undone"], backlog["flapped"], backlog["flap_rate"]) == (1, 0, 0, 0.0)
    assert body["total"]["cuts"] == 4 and body["total"]["flap_rate"] == 0.75
    assert client.get(URL, params={"since": "1h", "flap_ticks": 2}).json()["total"]["flapped"] == 0
    # only the cuts of the range are judged
    late = client.get(URL, params={"from": t0 + 50, "until": t0 + 200}).json()
    assert [c["reason"] for c in late["cuts"]] == ["HandoffBacklog"]
    assert late["truncated"] == []


def test_a_restarted_controller_counts_ticks_from_the_time(client: TestClient, world: World) -> None:
    t0 = world.clock() - 300.0
    _store(
        world,
        [
            {
                "ts": t0,
                "tick": 900,
                "subject": "decode-1",
                "field": "weight",
                "old_value": 1.0,
                "new_value": 0.5,
                "reason": "SlowHandoff",
                "epoch": 1,
            },
            {
                "ts": t0 + 8.0,
                "tick": 1,
                "subject": "decode-1",
                "field": "weight",
                "old_value": 0.5,
                "new_value": 1.0,
                "reason": "Recovering",
                "epoch": 2,
            },
        ],
    )
    (cut,) = client.get(URL, params={"since": "1h"}).json()["cuts"]
    assert cut["undone_after_ticks"] == 4  # 8 s at controller.interval_s 2, not 1 - 900


def test_no_decisions_no_cuts(client: TestClient) -> None:
    body = client.get(URL).json()  # the default range: the last hour
    assert body["cuts"] == [] and body["reasons"] == [] and body["total"]["cuts"] == 0
    assert body["total"]["flap_rate"] is None and body["until"] - body["since"] == 3600.0


@pytest.mark.parametrize(
    ("params", "status", "field"),
    [
        ({"since": "abc"}, 400, "since"),
        ({"since": "30d"}, 400, "since"),
        ({"from": "2000", "until": "1000"}, 400, "from"),
        ({"since": "30m", "from": "1"}, 400, "since"),
        ({"since": "1h", "flap_ticks": "0"}, 422, "flap_ticks"),
        ({"since": "1h", "cuts": "-1"}, 422, "cuts"),
    ],
)
def test_bad_parameters_are_named(
    client: TestClient, params: dict[str, str], status: int, field: str
) -> None:
    r = client.get(URL, params=params)
    assert r.status_code == status, r.text
    assert r.json()["detail"][0]["field"] == field


def test_the_route_is_an_open_read_in_the_openapi_document(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert {p["name"] for p in paths[URL]["get"]["parameters"]} == {
        "since",
        "from",
        "until",
        "flap_ticks",
        "cuts",
    }
    assert client.get(URL, headers={"Authorization": "Bearer wrong"}).status_code == 200


def _metric(text: str, name: str, reason: str) -> float | None:
    prefix = f'{name}{{reason="{reason}"}} '
    line = next((x for x in text.splitlines() if x.startswith(prefix)), None)
    return None if line is None else float(line[len(prefix) :])


def test_metrics_carry_the_live_flapping_tally(
    client: TestClient, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    t0 = world.clock() - 600.0
    flap = [
        {
            "ts": t0,
            "tick": 10,
            "subject": "decode-1",
            "field": "weight",
            "old_value": 1.0,
            "new_value": 0.5,
            "reason": "Backlog",
        },
        {
            "ts": t0 + 4.0,
            "tick": 12,
            "subject": "decode-1",
            "field": "weight",
            "old_value": 0.5,
            "new_value": 1.0,
            "reason": "Recovering",
        },
        {
            "ts": t0 + 10.0,
            "tick": 15,
            "subject": "decode-2",
            "field": "weight",
            "old_value": 1.0,
            "new_value": 0.5,
            "reason": "Backlog",
        },
    ]
    _store(world, flap)
    text = client.get("/metrics").text
    assert _metric(text, "pdscope_decision_cuts", "Backlog") == 2.0
    assert _metric(text, "pdscope_decision_flapped", "Backlog") == 1.0
    assert _metric(text, "pdscope_decision_flap_rate", "Backlog") == 0.5
    _store(
        world,
        [
            {
                "ts": t0 + 20.0,
                "tick": 20,
                "subject": "decode-3",
                "field": "weight",
                "old_value": 1.0,
                "new_value": 0.2,
                "reason": "SlowHandoff",
            }
        ],
    )
    assert _metric(client.get("/metrics").text, "pdscope_decision_cuts", "SlowHandoff") is None  # kept 30 s
    world.clock.advance(31.0)
    assert _metric(client.get("/metrics").text, "pdscope_decision_cuts", "SlowHandoff") == 1.0

    from controller import regret as mod
    from store.db import StoreError

    def down(*a: object, **k: object) -> None:
        raise StoreError("connection refused")

    monkeypatch.setattr(mod.reads, "decisions", down)
    world.clock.advance(31.0)
    r = client.get("/metrics")
    assert r.status_code == 200 and _metric(r.text, "pdscope_decision_cuts", "SlowHandoff") == 1.0  # the last
