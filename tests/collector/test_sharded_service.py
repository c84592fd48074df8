"""The collector service's share of the fleet: alone on SQLite, split with a peer on PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from collector.service import CollectorService
from pdscope.config import Settings, parse_config
from store.db import make_engine, session_factory
from store.migrate import upgrade
from store.models import CollectorMember, Snapshot
from tests.captures import SCRAPE_PAGES
from tests.support.serving import serve
from tests.support.sockets import closed_port_url
from tests.support.waiting import async_wait_until

NAMES = ("p0", "p1", "d0", "d1", "d2")


def _settings(store_url: str, urls: dict[str, str], extra: str = "") -> Settings:
    def pool(prefix: str) -> str:
        return ", ".join(f'{{name: {n}, url: "{u}"}}' for n, u in urls.items() if n.startswith(prefix))

    return parse_config(f"""
model: {{name: tiny, kv_bytes_per_token: 1024}}
pools:
  prefill: {{role: prefill, instances: [{pool("p")}]}}
  decode: {{role: decode, instances: [{pool("d")}]}}
store: {{url: "{store_url}"}}
collector: {{scrape_interval_s: 0.4, scrape_timeout_s: 0.3{extra}}}
""")


async def _healthz(service: CollectorService) -> dict[str, object]:
    transport = httpx.ASGITransport(app=service.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://collector") as client:
        doc: dict[str, object] = (await client.get("/healthz")).json()
        return doc


async def _close(service: CollectorService) -> None:
    service.sock.close()
    await service.client.aclose()


async def test_alone_on_sqlite_it_owns_every_instance(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    upgrade(url)
    urls = {n: closed_port_url() for n in NAMES}
    service = CollectorService(_settings(url, urls, ", id: collector-7"), port=0)
    try:
        assert [t.name for t in await service.shard.refresh()] == [t.name for t in service.targets]
        doc = await _healthz(service)
    finally:
        await _close(service)
    assert doc["collectors"] == {
        "id": "collector-7",
        "state": "solo",
        "live": ["collector-7"],
        "shares": {"collector-7": 5},
        "owned_targets": 5,
        "targets": 5,
        "window_s": 1.2,
    }
    assert service.shard.membership is None
    with session_factory(make_engine(url))() as s:
        assert s.scalars(select(CollectorMember)).all() == []  # SQLite: the table is never used


async def test_the_default_id_is_host_and_port(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    service = CollectorService(_settings(url, {n: closed_port_url() for n in NAMES}), port=0)
    await _close(service)
    assert service.id == f"{socket.gethostname()}:{service.port}"


def _metrics_app(body: bytes) -> Starlette:
    async def metrics(_request: Request) -> Response:
        return Response(body, media_type="text/plain")

    return Starlette(routes=[Route("/metrics", metrics)])


@pytest.fixture
async def fake_fleet() -> AsyncIterator[dict[str, str]]:
    pages = {"p": SCRAPE_PAGES / "prefill_metrics.txt", "d": SCRAPE_PAGES / "decode_metrics.txt"}
    async with contextlib.AsyncExitStack() as stack:
        yield {
            n: await stack.enter_async_context(serve(_metrics_app(pages[n[0]].read_bytes()))) for n in NAMES
        }


def _owned(service: CollectorService) -> set[str]:
    return {t.name for t in service.shard.owned}


@pytest.mark.parametrize("store_url", [pytest.param("postgresql", marks=pytest.mark.pg)], indirect=True)
async def test_two_collectors_on_postgresql_split_the_fleet_and_hand_over(
    store_url: str, fake_fleet: dict[str, str]
) -> None:
    upgrade(store_url)
    a = CollectorService(_settings(store_url, fake_fleet, ", id: collector-a"), port=0)
    b = CollectorService(_settings(store_url, fake_fleet, ", id: collector-b"), port=0)
    stop_a, stop_b = asyncio.Event(), asyncio.Event()
    run_a = asyncio.create_task(a.run(stop_a))
    run_b = asyncio.create_task(b.run(stop_b))
    try:
        await async_wait_until(
            "both collectors live with disjoint shares covering the fleet",
            lambda: (a.shard.state, b.shard.state, _owned(a), _owned(b)),
            done=lambda s: s[0] == s[1] == "ok" and not s[2] & s[3] and s[2] | s[3] == set(NAMES),
            timeout_s=20,
        )
        doc = await _healthz(a)
        assert doc["collectors"]["live"] == ["collector-a", "collector-b"]  # type: ignore[index]
        assert sum(doc["collectors"]["shares"].values()) == len(NAMES)  # type: ignore[index]

        stop_b.set()  # a clean stop leaves the membership: a takes b's share at its next round
        await asyncio.wait_for(run_b, timeout=15)
        await async_wait_until(
            "collector-a to scrape the whole fleet", lambda: _owned(a), done=lambda o: o == set(NAMES)
        )
        metrics = a.metrics.exposition().decode()
        assert "pdscope_collector_owned_targets 5.0" in metrics
        assert "pdscope_collector_live_collectors 1.0" in metrics
        factory = session_factory(make_engine(store_url))

        def stored() -> set[str]:
            with factory() as s:
                return set(s.scalars(select(Snapshot.instance).distinct()))

        await async_wait_until("a snapshot of every instance", stored, done=lambda seen: seen == set(NAMES))
    finally:
        stop_a.set()
        stop_b.set()
        await asyncio.wait_for(asyncio.gather(run_a, run_b, return_exceptions=True), timeout=15)


@pytest.mark.parametrize("store_url", [pytest.param("postgresql", marks=pytest.mark.pg)], indirect=True)
async def test_a_dead_collectors_instances_are_taken_over_on_postgresql(
    store_url: str, fake_fleet: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    upgrade(store_url)
    a = CollectorService(_settings(store_url, fake_fleet, ", id: collector-a"), port=0)
    b = CollectorService(_settings(store_url, fake_fleet, ", id: collector-b"), port=0)
    monkeypatch.setattr(b.shard, "leave", lambda: None)  # b dies: its row stays, its heartbeat ages
    stop_a, stop_b = asyncio.Event(), asyncio.Event()
    run_a = asyncio.create_task(a.run(stop_a))
    run_b = asyncio.create_task(b.run(stop_b))
    try:
        await async_wait_until(
            "both collectors scraping their shares",
            lambda: (a.shard.state, b.shard.state, _owned(a), _owned(b)),
            done=lambda s: s[0] == s[1] == "ok" and s[2] and s[3] and not s[2] & s[3],
            timeout_s=20,
        )
        share_b = _owned(b)
        stop_b.set()
        await asyncio.wait_for(run_b, timeout=15)
        with session_factory(make_engine(store_url))() as s:
            assert s.get(CollectorMember, "collector-b") is not None
        await async_wait_until(
            "collector-a to take collector-b's instances after its heartbeat expired",
            lambda: (_owned(a), a.shard.live),
            done=lambda o: o[0] == set(NAMES) and o[1] == ("collector-a",),
            timeout_s=20,
        )
        assert share_b <= _owned(a)
    finally:
        stop_a.set()
        stop_b.set()
        await asyncio.wait_for(asyncio.gather(run_a, run_b, return_exceptions=True), timeout=15)
