"""The surface a client expects: /v1/models (the models both roles serve, vLLM's shape, the smallest
max_model_len), /health (200 only when a P and a D are believed up), /version, and a clear 404 for
every other vLLM route; the catalog behind them (proxy.models), bounded and counted."""

from __future__ import annotations

import httpx
import pytest

from proxy.models import MAX_MODELS, Member, ModelCatalog, ModelInfoError, parse_models, refresh
from tests.proxy.conftest import fake_fleet, make_settings, running_proxy
from tests.proxy.test_context import learnt


async def test_models_health_and_version_through_the_proxy() -> None:
    async with fake_fleet(1, 2) as fleet:
        fleet.prefill[0].max_model_len = 8192
        fleet.decode[1].model = "only-on-d"
        settings = make_settings([fleet.prefill[0].url], [d.url for d in fleet.decode])
        async with running_proxy(settings) as (url, app), httpx.AsyncClient(timeout=10) as client:
            await learnt(app, "only-on-d")
            models = await client.get(url + "/v1/models")
            health = await client.get(url + "/health")
            version = await client.get(url + "/version")
    assert models.status_code == 200
    body = models.json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["fake"]  # both roles
    card = body["data"][0]
    assert card["max_model_len"] == 4096 and card["object"] == "model" and card["owned_by"] == "vllm"
    assert set(card) >= {"id", "created", "root", "parent", "permission"}
    assert health.status_code == 200 and health.json()["decode_up"] == 2
    v = version.json()
    assert v["server"] == "pdscope-proxy" and v["vllm"] == {"decode": ["0.32.0"], "prefill": ["0.32.0"]}


async def test_health_is_503_when_no_decode_instance_is_up() -> None:
    async with fake_fleet(1, 1) as fleet:
        settings = make_settings([fleet.prefill[0].url], [fleet.decode[0].url])
        async with running_proxy(settings) as (url, app), httpx.AsyncClient(timeout=10) as client:
            await learnt(app)
            app.parts.catalog.failed("d0", "connect")  # its last ask found nobody there
            resp = await client.get(url + "/health")
    assert resp.status_code == 503 and resp.json()["reason"] == "no decode instance believed up"


@pytest.mark.parametrize(
    "method,path",
    [
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("POST", "/v1/embeddings"),
        ("POST", "/pooling"),
        ("POST", "/v1/audio/transcriptions"),
        ("GET", "/load"),
    ],
)
async def test_other_vllm_routes_are_refused_by_name(method: str, path: str) -> None:
    async with fake_fleet(1, 1) as fleet:
        settings = make_settings([fleet.prefill[0].url], [fleet.decode[0].url])
        async with running_proxy(settings) as (url, _app), httpx.AsyncClient(timeout=10) as client:
            resp = await client.request(method, url + path, json={})
    assert resp.status_code == 404
    err = resp.json()["error"]
    assert err["code"] == "route_not_served" and f"{method} {path}" in err["message"]
    assert "completions" in err["message"]
    assert fleet.prefill[0].calls == [] and fleet.decode[0].calls == []


def test_the_catalog_takes_the_smallest_length_and_a_lora_takes_its_parents() -> None:
    cat = ModelCatalog()
    cat.retain([Member("p0", "prefill", "u"), Member("d0", "decode", "u")])
    base = {"id": "m", "object": "model", "max_model_len": 8192, "parent": None}
    lora = {"id": "ad", "object": "model", "max_model_len": None, "parent": "m"}
    cat.learnt("p0", parse_models({"data": [base, lora]}), "0.32.0", 1.0)
    cat.learnt("d0", parse_models({"data": [{**base, "max_model_len": 2048}]}), None, 1.0)
    assert cat.max_model_len("m") == 2048 and cat.max_model_len(None) == 2048
    assert cat.max_model_len("ad") == 8192  # only p0 serves the adapter: its base model's length
    assert cat.max_model_len("unknown") is None
    cat.retain([Member("p0", "prefill", "u")])  # d0 left the view: forgotten
    assert cat.max_model_len("m") == 8192


@pytest.mark.parametrize(
    "data",
    [
        [],
        {"data": "x"},
        {"data": [{"id": 7}]},
        {"data": [{"id": "m", "max_model_len": -1}]},
        {"data": [{"id": "m", "max_model_len": True}]},
        {"data": [{"id": "m" * 600}]},
    ],
)
def test_a_malformed_model_list_is_refused(data: object) -> None:
    with pytest.raises(ModelInfoError):
        parse_models(data)


def test_the_model_list_is_bounded() -> None:
    many = {"data": [{"id": f"m{i}", "max_model_len": 100} for i in range(MAX_MODELS * 2)]}
    assert len(parse_models(many)) == MAX_MODELS


async def test_a_failed_ask_is_counted_and_keeps_the_last_good_answer() -> None:
    counted: list[tuple[str, str]] = []
    cat = ModelCatalog(on_error=lambda inst, reason: counted.append((inst, reason)))
    members = [Member("p0", "prefill", "http://p0")]
    answers: dict[str, object] = {
        "http://p0/v1/models": {"data": [{"id": "m", "max_model_len": 100}]},
        "http://p0/version": {"version": "0.32.0"},
    }

    async def fetch(url: str) -> object:
        got = answers[url]
        if isinstance(got, ModelInfoError):
            raise got
        return got

    await refresh(cat, members, fetch, lambda: 1.0)
    answers["http://p0/v1/models"] = ModelInfoError("timeout")
    await refresh(cat, members, fetch, lambda: 2.0)
    assert cat.max_model_len("m") == 100 and counted == [("p0", "timeout")] and cat.unreachable("p0")
