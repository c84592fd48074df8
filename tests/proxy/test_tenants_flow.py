"""Tenants through a running proxy (``tenants.enabled``): a flood is its own, priority, limits with
Retry-After, hostile headers, the span attribute, and nothing at all when tenants are off."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdscope import semconv as sc
from pdscope.routing import ProxyShare
from proxy.app import ProxyApp, build
from proxy.request import RequestState
from tests.proxy.conftest import fake_fleet, make_settings, running_proxy
from tests.support.waiting import async_wait_until

STREAM = {"model": "fake", "prompt": "a b c d e f g h i j", "max_tokens": 4, "stream": True}
HEADER = "x-pdscope-tenant"


@asynccontextmanager
async def _proxy(
    tenants: dict[str, Any], exporter: InMemorySpanExporter | None = None, chunk_delay: float = 0.1
) -> AsyncIterator[tuple[str, ProxyApp, httpx.AsyncClient, Any]]:
    """A proxy over one P and one D whose decode holds the pools' single slot ~0.4 s a request."""
    async with fake_fleet(1, 1, n_chunks=4, chunk_delay=chunk_delay) as fleet:
        settings = make_settings(
            [fleet.prefill[0].url],
            [fleet.decode[0].url],
            proxy={"admission": {"max_inflight_requests": 1, "queue_timeout_s": 10}},
        )
        settings = settings.model_copy(
            update={"tenants": type(settings.tenants).model_validate({"enabled": True, **tenants})}
        )
        async with (
            running_proxy(settings, exporter) as (url, app),
            httpx.AsyncClient(timeout=30) as client,
        ):
            yield url, app, client, fleet


async def _post(client: httpx.AsyncClient, url: str, tenant: str | None, **body: Any) -> httpx.Response:
    headers = {} if tenant is None else {HEADER: tenant}
    return await client.post(url + "/v1/completions", json={**STREAM, **body}, headers=headers)


def _rejected(metrics: str, tenant: str, reason: str) -> float:
    return _sample(metrics, f'pdscope_proxy_tenant_rejections_total{{reason="{reason}",tenant="{tenant}"}}')


def _sample(metrics: str, line: str) -> float:
    for row in metrics.splitlines():
        if row.startswith(line + " "):
            return float(row.rsplit(" ", 1)[1])
    return 0.0


async def test_a_flood_fills_its_own_queue_and_gets_its_own_429s() -> None:
    """a sends 12 at once into one slot: 1 runs, 2 wait (its bound), 9 get tenant_queue_full. b's
    requests arriving then are served: a's flood took none of b's places (the queue's overall bound
    is 4 here: without a's own bound, a's flood would fill it and b would get queue_full)."""
    async with _proxy({"tenants": {"a": {"max_queued": 2}, "b": {"max_queued": 2}}}) as (url, app, client, _):
        fair = app.parts.admission.fair
        assert fair is not None
        fair.max_waiters = 4
        flood = [asyncio.create_task(_post(client, url, "a")) for _ in range(12)]
        await async_wait_until("a's queue full", lambda: fair.queued("a") == 2)
        await async_wait_until("a's excess refused", lambda: sum(t.done() for t in flood) == 9)
        b = await asyncio.gather(*(_post(client, url, "b") for _ in range(2)))
        a = await asyncio.gather(*flood)
        metrics = (await client.get(url + "/metrics")).text
    assert [r.status_code for r in b] == [200, 200]
    assert sorted(r.status_code for r in a) == [200] * 3 + [429] * 9
    refused = [r for r in a if r.status_code == 429]
    assert {r.json()["error"]["code"] for r in refused} == {"tenant_queue_full"}
    assert all(r.headers["retry-after"] for r in refused)
    assert _rejected(metrics, "a", "tenant_queue_full") == 9
    assert 'tenant="b"' not in "".join(r for r in metrics.splitlines() if "tenant_rejections" in r)
    assert _sample(metrics, 'pdscope_proxy_tenant_admitted_total{tenant="b"}') == 2
    assert _sample(metrics, 'pdscope_proxy_tenant_admitted_total{tenant="a"}') == 3
    assert _sample(metrics, 'pdscope_proxy_tenant_tokens_total{kind="prompt",tenant="b"}') > 0
    assert 'pdscope_proxy_tenant_queued_seconds_count{tenant="b"} 2.0' in metrics
    assert 0.5 <= _sample(metrics, "pdscope_proxy_tenant_fairness_jain") <= 1.0  # two backlogged tenants


async def test_a_batch_tenant_alone_uses_the_fleet_and_yields_to_an_interactive_arrival() -> None:
    tenants = {"tenants": {"batch": {"priority": "batch"}, "live": {"priority": "interactive"}}}
    async with _proxy(tenants) as (url, app, client, fleet):
        fair = app.parts.admission.fair
        assert fair is not None
        batch = [asyncio.create_task(_post(client, url, "batch", prompt=f"batch {i}")) for i in range(4)]
        await async_wait_until("batch's 3 waiting", lambda: fair.queued("batch") == 3)
        live = await _post(client, url, "live", prompt="live one")
        done = await asyncio.gather(*batch)
    assert live.status_code == 200 and all(r.status_code == 200 for r in done)
    order = [c["body"]["prompt"] for c in fleet.prefill[0].calls]
    assert order.index("live one") == 1, order  # right after the batch request that held the slot


async def test_a_higher_class_sheds_the_lowest_waiter_with_a_429_when_the_queue_is_full() -> None:
    tenants = {"tenants": {"batch": {"priority": "batch"}, "live": {"priority": "interactive"}}}
    async with _proxy(tenants) as (url, app, client, _):
        fair = app.parts.admission.fair
        assert fair is not None
        fair.max_waiters = 2
        batch = [asyncio.create_task(_post(client, url, "batch", prompt=f"batch {i}")) for i in range(3)]
        await async_wait_until("batch's 2 waiting", lambda: fair.queued("batch") == 2)
        live = await _post(client, url, "live")
        done = await asyncio.gather(*batch)
        metrics = (await client.get(url + "/metrics")).text
    assert live.status_code == 200
    shed = [r for r in done if r.status_code == 429]
    assert len(shed) == 1 and shed[0].json()["error"]["code"] == "shed_for_priority"
    assert "priority" in shed[0].json()["error"]["message"]
    assert _rejected(metrics, "batch", "shed_for_priority") == 1


async def test_rate_and_quota_answer_429_with_retry_after() -> None:
    tenants = {"tenants": {"r": {"rate_rps": 0.2, "burst": 1}, "q": {"tokens_per_min": 30}}}
    async with _proxy(tenants, chunk_delay=0.0) as (url, _, client, _):
        assert (await _post(client, url, "r")).status_code == 200
        rated = await _post(client, url, "r")
        assert (await _post(client, url, "q")).status_code == 200  # ~3 prompt tokens + 4: within 30
        quota = await _post(client, url, "q", max_tokens=25)
        metrics = (await client.get(url + "/metrics")).text
    assert rated.status_code == 429 and rated.json()["error"]["code"] == "tenant_rate"
    assert 1 <= int(rated.headers["retry-after"]) <= 5
    assert quota.status_code == 429 and quota.json()["error"]["code"] == "tenant_quota"
    assert int(quota.headers["retry-after"]) >= 1
    assert _rejected(metrics, "r", "tenant_rate") == 1
    assert _rejected(metrics, "q", "tenant_quota") == 1


async def test_hostile_headers_are_mapped_to_default_and_counted_and_the_span_says_the_tenant() -> None:
    spans = InMemorySpanExporter()
    async with _proxy({"tenants": {"a": {}}}, spans, chunk_delay=0.0) as (url, _app, client, _):
        got = [await _post(client, url, t) for t in ("a", "nobody", "x" * 5000, "a\tb", None)]
        metrics = (await client.get(url + "/metrics")).text
        await async_wait_until("5 root spans", lambda: len(_roots(spans)) == 5)
    assert [r.status_code for r in got] == [200] * 5
    assert sorted(s.attributes[sc.TENANT] for s in _roots(spans)) == ["a", *["default"] * 4]
    for reason in ("unknown", "too_long", "malformed"):
        assert _sample(metrics, f'pdscope_proxy_tenant_unresolved_total{{reason="{reason}"}}') == 1
    assert 'tenant="nobody"' not in metrics and "xxxx" not in metrics


async def test_with_refuse_an_unknown_tenant_is_a_400_naming_the_header() -> None:
    refuse = {"unknown": "refuse", "tenants": {"a": {}}}
    async with _proxy(refuse, chunk_delay=0.0) as (url, _, client, fleet):
        refused = await _post(client, url, "nobody")
        ok = await _post(client, url, None)  # no header: default's, not a problem
    assert refused.status_code == 400
    err = refused.json()["error"]
    assert err["code"] == "invalid_tenant" and err["param"] == HEADER and "nobody" not in err["message"]
    assert ok.status_code == 200 and len(fleet.prefill[0].calls) == 1


async def test_tenants_off_change_nothing() -> None:
    spans = InMemorySpanExporter()
    async with fake_fleet(1, 1) as fleet:
        settings = make_settings([fleet.prefill[0].url], [fleet.decode[0].url])
        async with running_proxy(settings, spans) as (url, app), httpx.AsyncClient(timeout=10) as client:
            r = await client.post(url + "/v1/completions", json=STREAM, headers={HEADER: "x" * 300})
            metrics = (await client.get(url + "/metrics")).text
            await async_wait_until("a root span", lambda: len(_roots(spans)) == 1)
    assert r.status_code == 200
    assert app.parts.admission.fair is None and app.parts.tenancy is None
    assert "pdscope_proxy_tenant" not in metrics
    assert sc.TENANT not in (_roots(spans)[0].attributes or {})


async def test_the_report_counts_tenants_and_the_answer_scales_their_weights() -> None:
    async with _proxy({"tenants": {"a": {}, "b": {}}}, chunk_delay=0.0) as (url, app, client, _):
        for t in ("a", "a", "b", None):
            assert (await _post(client, url, t)).status_code == 200
        assert app.report().tenants == {"a": 2, "b": 1, "default": 1}
        routing, fair = app.parts.routing, app.parts.admission.fair
        assert fair is not None
        part = ProxyShare(id=routing.proxy_id, live=3, pools={}, tenants={"b": 0.25})
        routing.share, routing.share_at = part, app.parts.clock()
        app.report()
        assert (fair.weight("a"), fair.weight("b")) == (1.0, 0.25)
        routing.share = None  # no part (controller gone): weights whole again
        app.report()
        assert fair.weight("b") == 1.0
        metrics = (await client.get(url + "/metrics")).text
    assert 'pdscope_proxy_tenant_weight_scale{tenant="b"} 1.0' in metrics


def _roots(spans: InMemorySpanExporter) -> list[Any]:
    return [s for s in spans.get_finished_spans() if s.name == sc.SPAN_REQUEST]


def _request(tenant: str, clock: float) -> RequestState:
    req = RequestState("/v1/completions", f"r-{tenant}")
    req.tenant, req.tokens, req.decode_tokens, req.started, req.target_s = tenant, 10, 4, clock, 60.0
    return req


def _one_slot_app(queue_timeout_s: float) -> ProxyApp:
    """A proxy (not serving) over one P and one D, a slot a pool, tenants ``a`` and ``b`` declared."""
    settings = make_settings(
        ["http://p0:1"],
        ["http://d0:1"],
        proxy={"admission": {"max_inflight_requests": 1, "queue_timeout_s": queue_timeout_s}},
    )
    tenants = type(settings.tenants).model_validate({"enabled": True, "tenants": {"a": {}, "b": {}}})
    return build(
        settings.model_copy(update={"tenants": tenants}), exporter=InMemorySpanExporter(), poll=False
    )


async def test_an_arrival_does_not_take_a_freed_slot_from_a_waiter_that_ranks_before_it() -> None:
    """The pools' one slot frees while b waits (woken, not yet run); a's new request, arriving in that
    instant, must queue behind b (a has been served, b not) rather than take the slot."""
    app = _one_slot_app(queue_timeout_s=0.3)
    gate, fair, now = app.parts.flow.gate, app.parts.admission.fair, app.parts.clock
    assert fair is not None
    first = _request("a", now())
    assert await gate.admit(first) is None
    waiter = asyncio.create_task(gate.admit(_request("b", now())))
    await async_wait_until("b waiting", lambda: fair.queued("b") == 1)
    gate.release(first)  # the slot is free; b is woken but has not run
    late = await gate.admit(_request("a", now()))  # runs inline up to its first wait
    assert await waiter is None  # b had the slot
    assert late is not None and late.reason == "inflight_requests"  # a waited behind b, then timed out


async def test_the_waiters_are_ordered_by_the_counter_of_the_pool_that_refused_them() -> None:
    """P's slot is free and D's is not (the first request is decoding): b's request waits for D, so the
    fair queue orders the waiters by D's counters; once b is admitted nobody waits, and the pool is
    forgotten."""
    app = _one_slot_app(queue_timeout_s=5)
    gate, fair, now = app.parts.flow.gate, app.parts.admission.fair, app.parts.clock
    assert fair is not None
    first = _request("a", now())
    assert await gate.admit(first) is None
    assert first.p_slot is not None and first.charged is not None
    app.parts.admission.leave(first.p_slot)  # prefill done: P's slot back, D's still held
    first.p_slot = None
    waiter = asyncio.create_task(gate.admit(_request("b", now())))
    await async_wait_until("b waiting", lambda: fair.queued("b") == 1)
    assert fair.tight == "decode"
    gate.release(first)
    assert await waiter is None
    assert fair.tight is None
