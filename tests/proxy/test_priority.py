"""The ``priority`` the proxy sends to priority-scheduled instances (``proxy.priority``): set from the
tenant's class and share, never the client's with tenants on, absent for fcfs instances, and the body
untouched with tenants off."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from pdscope.config import Settings
from proxy.app import ProxyApp
from proxy.fairqueue import FairQueue, Work
from proxy.priority import INT64_MAX, request_priority, with_priority, without_client_priority
from tests.proxy.conftest import fake_fleet, make_settings, running_proxy

BODY = {"model": "fake", "prompt": "a b c d", "max_tokens": 2, "stream": True}
TENANTS = {"tenants": {"live": {"priority": "interactive"}, "bulk": {"priority": "batch"}}}


def _settings(p_url: str, d_url: str, tenants: bool, p_scheduling: str = "priority") -> Settings:
    s = make_settings([p_url], [d_url])
    pools = {
        n: p.model_copy(update={"scheduling": p_scheduling}) if p.role == "prefill" else p
        for n, p in s.pools.items()
    }
    ts = type(s.tenants).model_validate({"enabled": tenants, **TENANTS})
    return s.model_copy(update={"pools": pools, "tenants": ts})


@asynccontextmanager
async def _proxy(tenants: bool, p_scheduling: str = "priority") -> AsyncIterator[tuple[str, ProxyApp, Any]]:
    async with fake_fleet(1, 1, n_chunks=2, chunk_delay=0.0) as fleet:
        settings = _settings(fleet.prefill[0].url, fleet.decode[0].url, tenants, p_scheduling)
        async with running_proxy(settings) as (url, app):
            yield url, app, fleet


async def _send(url: str, tenant: str, **body: Any) -> tuple[httpx.Response, str]:
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(
            url + "/v1/completions", json={**BODY, **body}, headers={"x-pdscope-tenant": tenant}
        )
        metrics = (await client.get(url + "/metrics")).text
    return r, metrics


def _bodies(fleet: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    return fleet.prefill[0].calls[-1]["body"], fleet.decode[0].calls[-1]["body"]


async def test_the_proxy_sets_the_priority_to_priority_scheduled_instances_and_replaces_the_clients() -> None:
    async with _proxy(tenants=True) as (url, _, fleet):
        r, metrics = await _send(url, "bulk", priority=-1000)  # a batch client asking to go first
        assert r.status_code == 200
        p_body, d_body = _bodies(fleet)
        assert p_body["priority"] == 2  # batch's rank 1, within its share: never the client's -1000
        assert "priority" not in d_body  # D's pool is fcfs: no priority at all
        assert 'pdscope_proxy_tenant_client_priority_total{tenant="bulk"} 1.0' in metrics
        r, _ = await _send(url, "live")
        p_body, d_body = _bodies(fleet)
        assert r.status_code == 200 and p_body["priority"] == 0 and "priority" not in d_body


async def test_an_fcfs_fleet_gets_no_priority_even_from_the_client() -> None:
    async with _proxy(tenants=True, p_scheduling="fcfs") as (url, _, fleet):
        r, _ = await _send(url, "live", priority=-5)
        p_body, d_body = _bodies(fleet)
    assert r.status_code == 200 and "priority" not in p_body and "priority" not in d_body


async def test_with_tenants_off_the_body_goes_as_it_came() -> None:
    async with _proxy(tenants=False) as (url, _, fleet):
        r, metrics = await _send(url, "bulk", priority=7)
        p_body, d_body = _bodies(fleet)
    assert r.status_code == 200 and p_body["priority"] == 7 and d_body["priority"] == 7
    assert "client_priority" not in metrics


def test_the_value_orders_classes_then_share_and_stays_within_int64() -> None:
    assert [request_priority(r, o) for r, o in ((0, False), (0, True), (1, False), (1, True))] == [0, 1, 2, 3]
    assert request_priority(-4, False) == 0 and request_priority(2**70, True) == INT64_MAX


def test_a_tenant_served_past_its_share_of_its_class_is_over_share() -> None:
    ts = type(make_settings(["http://p"], ["http://d"]).tenants).model_validate(
        {
            "enabled": True,
            "tenants": {"a": {}, "b": {}, "c": {"priority": "batch"}},
            **{"classes": ["interactive", "batch"]},
        }
    )
    fair = FairQueue(ts, 64, lambda: 100.0)
    assert not fair.over_share("a")  # alone and nothing waiting
    for tenant, tokens in (("a", 3000), ("b", 1000), ("c", 99_000)):
        if tenant == "b":
            assert not fair.over_share("a")  # no busy peer of its class
        fair.admitted(tenant, Work(tokens))  # in flight: busy; another class's service is not a's business
    assert fair.over_share("a") and not fair.over_share("b") and not fair.over_share("c")


@pytest.mark.parametrize("raw", [b'{"model": "m", "prompt": "x"}', b'{"a": 1}\n', b"{}", b"{ }"])
def test_with_priority_adds_the_field_to_the_bytes(raw: bytes) -> None:
    assert json.loads(with_priority(raw, 3)) == {**json.loads(raw), "priority": 3}


def test_without_client_priority_re_encodes_only_when_there_was_one() -> None:
    body = {"model": "m"}
    raw = b'{"model":   "m"}'
    assert without_client_priority(body, raw) == (raw, False)
    body = {"model": "m", "priority": -9}
    out, had = without_client_priority(body, b"ignored")
    assert had and body == {"model": "m"} and json.loads(out) == {"model": "m"}
