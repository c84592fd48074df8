"""The control API under hostile input: auth before the body, bounded bodies, strict types,
X-Actor, identities and whoami, restarts and ETags, pool override end, audit after commit."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from controller.api import create_app
from controller.auth import IdentityConfigError, load_tokens, sanitise_actor
from controller.loop import Reconciler
from controller.wiring import default_effects
from proxy.routing import RoutingState, poll_once
from store.db import session_factory, transaction
from store.models import AuditEvent, WeightOverride
from tests.controller.conftest import World

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"content-type": "application/json"}
BODY = {"weight": 0.5, "ttl_s": 60, "reason": "x"}


@pytest.fixture
def client(world: World) -> Iterator[TestClient]:
    world.step()
    with TestClient(
        create_app(world.reconciler, token=TOKEN, tokens={"alice": "alice-token", "bob": "bob-token"}),
        raise_server_exceptions=False,
    ) as c:
        yield c


def counts(world: World) -> tuple[int, int]:
    with transaction(world.factory) as s:
        return (
            s.scalar(select(func.count()).select_from(WeightOverride)) or 0,
            s.scalar(select(func.count()).select_from(AuditEvent)) or 0,
        )


def fields(r: httpx.Response) -> set[str]:
    return {p["field"] for p in r.json()["detail"]}


def asgi(
    app: Any,
    method: str,
    path: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes = b"",
    *,
    endless: bool = False,
) -> tuple[int, bytes, int]:
    """One request straight into the ASGI app, headers as raw bytes (HTTP clients re-encode them).
    Returns (status, body, how many times the app called receive())."""
    reads = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        if endless:  # a huge body, but bounded: 64 chunks of 64 KiB, so a reader that reads it all ends
            return {"type": "http.request", "body": b"x" * 65536, "more_body": reads < 64}
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8300),
        "headers": headers,
    }
    asyncio.run(app(scope, receive, send))
    out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], out, reads


# -- item 9: authenticate before reading the body, bound the body ----------------------------


def test_malformed_json_without_a_token_is_401(client: TestClient, world: World) -> None:
    r = client.put("/v1/instances/decode-1/weight", content=b"{bad", headers=JSON)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    r = client.put(
        "/v1/instances/decode-1/weight", content=b"{bad", headers={**JSON, "Authorization": "Bearer no"}
    )
    assert r.status_code == 401
    r = client.put("/v1/instances/decode-1/weight", content=b"{bad", headers={**JSON, **AUTH})
    assert r.status_code == 422 and fields(r) == {"body"}
    assert counts(world) == (0, 0)


def test_no_body_byte_is_read_before_the_token_is_checked(world: World) -> None:
    """Driven at the ASGI level: an unauthenticated PUT is answered 401 without one receive()."""
    world.step()
    app = create_app(world.reconciler, token=TOKEN)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(300 * 2**20).encode())]
    status, _, reads = asgi(app, "PUT", "/v1/instances/decode-1/weight", headers, endless=True)
    assert status == 401 and reads == 0
    # with the token, a declared 300 MB body is refused by its Content-Length, still unread
    status, _, reads = asgi(
        app,
        "PUT",
        "/v1/instances/decode-1/weight",
        [*headers, (b"authorization", f"Bearer {TOKEN}".encode())],
        endless=True,
    )
    assert status == 413 and reads == 0


def test_a_body_over_the_limit_is_413(client: TestClient, world: World) -> None:
    limit = world.settings.controller.max_body_bytes
    big = json.dumps({**BODY, "reason": "x" * limit}).encode()
    r = client.put("/v1/instances/decode-1/weight", content=big, headers={**JSON, **AUTH})
    assert r.status_code == 413 and str(limit) in r.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while reading
        for _ in range(limit // 1024 + 2):
            yield b" " * 1024

    r = client.put("/v1/instances/decode-1/weight", content=chunks(), headers={**JSON, **AUTH})
    assert r.status_code == 413
    assert counts(world) == (0, 0)


def test_deep_json_is_422_naming_the_body(client: TestClient, world: World) -> None:
    for deep in (b"[" * 60_000, b'{"weight": ' + b"[" * 40 + b"]" * 40 + b', "ttl_s": 1, "reason": "x"}'):
        r = client.put("/v1/instances/decode-1/weight", content=deep, headers={**JSON, **AUTH})
        assert r.status_code == 422 and fields(r) == {"body"}, r.text
    # brackets inside strings are text, not nesting
    r = client.put(
        "/v1/instances/decode-1/weight",
        content=json.dumps({**BODY, "reason": "[" * 100}).encode(),
        headers={**JSON, **AUTH},
    )
    assert r.status_code == 200


# -- low: strict body types, non-finite numbers ----------------------------------------------


@pytest.mark.parametrize(
    "raw,field",
    [
        (b'{"weight": "0.5", "ttl_s": 60, "reason": "x"}', "weight"),
        (b'{"weight": true, "ttl_s": 60, "reason": "x"}', "weight"),
        (b'{"weight": 0.5, "ttl_s": "60", "reason": "x"}', "ttl_s"),
        (b'{"weight": 0.5, "ttl_s": false, "reason": "x"}', "ttl_s"),
        (b'{"weight": 1e400, "ttl_s": 60, "reason": "x"}', "weight"),
        (b'{"weight": 0.5, "ttl_s": 1e400, "reason": "x"}', "ttl_s"),
        (b'{"weight": NaN, "ttl_s": 60, "reason": "x"}', "weight"),
        (b'{"weight": 0.5, "ttl_s": 60, "reason": "   "}', "reason"),
        (b'{"weight": 0.5, "ttl_s": 60, "reason": "\\t\\n"}', "reason"),
        (b'{"weight": 0.5, "ttl_s": 60, "reason": 5}', "reason"),
        (b'{"weight": 0.5, "ttl_s": 60, "reason": "a\\u0000b"}', "reason"),
        (b'{"weight": 0.5, "ttl_s": 60, "reason": "a\\u001bb"}', "reason"),
    ],
)
def test_lax_types_are_refused_naming_the_field(
    client: TestClient, world: World, raw: bytes, field: str
) -> None:
    r = client.put("/v1/instances/decode-1/weight", content=raw, headers={**JSON, **AUTH})
    assert r.status_code == 422 and field in fields(r), r.text
    assert counts(world) == (0, 0)


def test_reason_is_stripped_and_bounded(client: TestClient, world: World) -> None:
    r = client.put("/v1/instances/decode-1/weight", json={**BODY, "reason": "  slow NIC\n"}, headers=AUTH)
    assert r.status_code == 200 and r.json()["override"]["reason"] == "slow NIC"
    r = client.put("/v1/instances/decode-1/weight", json={**BODY, "reason": "x" * 501}, headers=AUTH)
    assert r.status_code == 422 and fields(r) == {"reason"}
    r = client.post("/v1/instances/decode-1/drain", json={"reason": "x", "ttl_s": "5"}, headers=AUTH)
    assert r.status_code == 422 and fields(r) == {"ttl_s"}


# -- identities, X-Actor, whoami ---------------------------------------------------------------


def test_whoami(client: TestClient) -> None:
    assert client.get("/v1/whoami", headers=AUTH).json() == {"identity": "api"}
    assert client.get("/v1/whoami", headers={"Authorization": "Bearer alice-token"}).json() == {
        "identity": "alice"
    }
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic alice-token"}):
        r = client.get("/v1/whoami", headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert client.get("/v1/whoami", params={"token": "alice-token"}).status_code == 401  # headers only


def test_whoami_without_tokens_is_401(world: World) -> None:
    with TestClient(create_app(world.reconciler, token=None)) as c:
        assert c.get("/v1/whoami", headers=AUTH).status_code == 401


def actor_of(client: TestClient, world: World, headers: dict[str, Any]) -> httpx.Response:
    r = client.put("/v1/instances/decode-1/weight", json=BODY, headers=headers)
    return r


def test_the_actor_is_the_identity_on_behalf_of_x_actor(client: TestClient, world: World) -> None:
    r = actor_of(client, world, {"Authorization": "Bearer bob-token", "X-Actor": "carol"})
    assert r.status_code == 200 and r.json()["override"]["actor"] == "bob:carol"
    r = actor_of(client, world, {"Authorization": "Bearer alice-token"})
    assert r.json()["override"]["actor"] == "alice"
    with transaction(world.factory) as s:
        assert [e.actor for e in s.scalars(select(AuditEvent).order_by(AuditEvent.id))] == [
            "bob:carol",
            "alice",
        ]


def test_x_actor_is_sanitised(client: TestClient, world: World) -> None:
    app = client.app

    def put(raw: bytes) -> tuple[int, Any]:
        body = json.dumps(BODY).encode()
        status, out, _ = asgi(
            app,
            "PUT",
            "/v1/instances/decode-1/weight",
            [
                (b"authorization", f"Bearer {TOKEN}".encode()),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"x-actor", raw),
            ],
            body,
        )
        doc = json.loads(out)
        return status, doc["override"]["actor"] if status == 200 else doc

    assert put("José".encode()) == (200, "api:José")
    assert put("Jose\u0301".encode()) == (200, "api:José")  # NFC
    assert put("ali\x7fce\u202e\u200b\x1b".encode()) == (200, "api:alice")  # controls, bidi, zero-width
    assert put(("é" * 70).encode()) == (200, "api:" + "é" * 64)
    assert put(b"   ") == (200, "api")
    status, doc = put("José".encode("latin-1"))  # not UTF-8: refused, never stored as mojibake
    assert status == 400 and doc["detail"][0]["field"] == "X-Actor"
    status, _ = put(b"Jos" + "é".encode()[:1])  # cut inside a character
    assert status == 400


def test_x_actor_is_never_cut_inside_a_combining_sequence() -> None:
    # q + combining acute has no precomposed form: NFC keeps two code points
    assert sanitise_actor(("a" * 63 + "q\u0301").encode()) == "a" * 63
    assert sanitise_actor(("q" * 64 + "\u0301\u0302").encode()) == "q" * 63
    assert sanitise_actor(None) is None and sanitise_actor(b"\x00\x01") is None


def test_named_tokens_are_parsed_and_checked() -> None:
    from pdscope.config import parse_config

    settings = parse_config(
        "model: {name: m, kv_bytes_per_token: 1}\npools:\n  p: {role: prefill, instances: "
        "[{name: p0, url: 'http://127.0.0.1:1'}]}\n  d: {role: decode, instances: "
        "[{name: d0, url: 'http://127.0.0.1:2'}]}\n",
        "t.yaml",
    )
    env = {"PDSCOPE_API_TOKENS": "alice:ta, bob:tb", "PDSCOPE_API_TOKEN": "t0"}
    assert load_tokens(settings, env) == {"alice": "ta", "bob": "tb", "api": "t0"}
    for bad in ("alice", "alice:", ":tok", "al ice:t", "a:t,a:u", "a:t,b:t", "api:other"):
        with pytest.raises(IdentityConfigError, match="PDSCOPE_API_TOKENS"):
            load_tokens(settings, {"PDSCOPE_API_TOKENS": bad, "PDSCOPE_API_TOKEN": "t0"})


# -- item 2: a restart never reuses an ETag -----------------------------------------------------


def test_a_restarted_controller_never_answers_304_to_a_stale_table(world: World) -> None:
    """The issue's reproduction: controller 1 serves an override zeroing decode-1 as a version no
    stored decision records (the API applied it between ticks). The override ends, the controller
    restarts, counts versions from the store and reaches the same number with decode-1 back at 1.0.
    A proxy holding controller 1's ETag must get the new table, not a 304."""
    world.step()
    state = RoutingState(world.settings, 0.0)

    async def poll(app: Any) -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ctl") as c:
            await poll_once(state, c, "http://ctl/v1/routing", lambda: 1.0)

    app1 = create_app(world.reconciler, token=TOKEN)
    with TestClient(app1) as c1:
        assert (
            c1.put(
                "/v1/instances/decode-1/weight", json={**BODY, "weight": 0.0, "ttl_s": 3}, headers=AUTH
            ).status_code
            == 200
        )
    asyncio.run(poll(app1))
    first_version, first_etag = state.view.version, state.etag
    assert "decode-1" not in {t.name for t in state.view.decode}
    world.clock.advance(4.0)  # the override has ended; controller 1 stops before its next tick

    factory2 = session_factory(world.factory.kw["bind"])
    rec2 = Reconciler(
        world.settings,
        factory2,
        effects=default_effects(world.settings, factory2, clock=world.clock),
        clock=world.clock,
    )
    rec2.tick()
    assert rec2.table.version == first_version  # the number repeats ...
    asyncio.run(poll(create_app(rec2, token=TOKEN)))
    assert state.etag != first_etag  # ... the ETag does not: the proxy got a 200 and the new table
    assert any(t.name == "decode-1" and t.weight == 1.0 for t in state.view.decode)
    assert rec2.epoch != world.reconciler.epoch


# -- low: pool override end, instance DELETE reason, audit after commit ------------------------


def test_a_pool_override_can_be_ended_early(client: TestClient, world: World) -> None:
    assert client.put("/v1/pools/decode/weight", json=BODY, headers=AUTH).status_code == 200
    r = client.request("DELETE", "/v1/pools/decode/weight", json={"reason": "done"}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["weight"] == 1.0 and r.json()["override"] is None and r.json()["audit_id"]
    pools = {p["name"]: p for p in client.get("/v1/routing").json()["pools"]}
    assert pools["decode"]["weight"] == 1.0 and pools["decode"]["reason"] != "ManualOverride"
    with transaction(world.factory) as s:
        evs = s.scalars(select(AuditEvent).order_by(AuditEvent.id)).all()
        assert [e.action for e in evs] == ["pool_weight.set", "pool_weight.clear"]
        assert evs[1].before == {"weight": 0.5, "override_id": evs[0].override_id}
        assert evs[1].after == {"weight": 1.0, "override_id": None} and evs[1].reason == "done"
    r = client.request("DELETE", "/v1/pools/decode/weight", json={"reason": "again"}, headers=AUTH)
    assert r.status_code == 409 and "no active weight override" in r.json()["detail"]
    assert (
        client.request("DELETE", "/v1/pools/nope/weight", json={"reason": "x"}, headers=AUTH).status_code
        == 404
    )
    assert client.request("DELETE", "/v1/pools/decode/weight", json={"reason": "x"}).status_code == 401


def test_an_instance_delete_answers_the_policy_reason(client: TestClient, world: World) -> None:
    policy_reason = client.get("/v1/instances/decode-1/weight").json()["reason"]
    assert policy_reason != "ManualOverride"
    client.put("/v1/instances/decode-1/weight", json=BODY, headers=AUTH)
    r = client.request("DELETE", "/v1/instances/decode-1/weight", json={"reason": "done"}, headers=AUTH)
    assert r.status_code == 200 and r.json()["source"] == "policy"
    assert r.json()["reason"] == policy_reason


def test_the_audit_line_is_logged_only_after_commit(client: TestClient, world: World) -> None:
    """When the line is written, another connection already sees the audit row."""
    seen: list[bool] = []

    class Check(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            audit_id = json.loads(record.getMessage())["audit_id"]
            with transaction(world.factory) as s:
                seen.append(s.get(AuditEvent, audit_id) is not None)

    handler = Check()
    logger = logging.getLogger("controller.audit")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        assert client.put("/v1/instances/decode-1/weight", json=BODY, headers=AUTH).status_code == 200
        assert (
            client.post("/v1/instances/decode-1/drain", json={"reason": "x"}, headers=AUTH).status_code == 200
        )
        # a refused mutation writes no audit row and logs no line
        assert (
            client.post("/v1/instances/decode-2/undrain", json={"reason": "x"}, headers=AUTH).status_code
            == 409
        )
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    assert seen == [True, True]


# -- what held: parameterised SQL, auth headers only --------------------------------------------


def test_sql_in_names_and_queries_is_data(client: TestClient, world: World) -> None:
    evil = "decode-1' OR '1'='1"
    assert client.put(f"/v1/instances/{evil}/weight", json=BODY, headers=AUTH).status_code == 404
    r = client.get("/v1/decisions", params={"subject": "x' OR 1=1 --"})
    assert r.status_code == 200 and r.json() == []
    assert counts(world) == (0, 0)


def test_the_token_is_only_read_from_the_authorization_header(client: TestClient, world: World) -> None:
    for kwargs in (
        {"params": {"token": TOKEN}},
        {"params": {"access_token": TOKEN}},
        {"headers": {"X-Api-Token": TOKEN}},
        {"cookies": {"token": TOKEN}},
    ):
        assert client.put("/v1/instances/decode-1/weight", json=BODY, **kwargs).status_code == 401
    assert counts(world) == (0, 0)
