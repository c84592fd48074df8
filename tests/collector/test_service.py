"""The whole collector process: scrape two fake instances, receive a trace, store, serve /metrics."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from collector.service import CollectorService
from pdscope.config import parse_config
from store.db import make_engine, session_factory
from store.migrate import upgrade
from store.models import InstanceRow, RequestRecord, Snapshot
from tests.captures import SCRAPE_PAGES
from tests.collector.traces import request_spans, to_proto
from tests.support.serving import serve
from tests.support.sockets import closed_port_url
from tests.support.waiting import async_wait_until

FIXTURES = SCRAPE_PAGES


def _metrics_app(body: bytes) -> Starlette:
    async def metrics(_request: Request) -> Response:
        return Response(body, media_type="text/plain")

    return Starlette(routes=[Route("/metrics", metrics)])


@pytest.fixture
async def fake_vllm() -> AsyncIterator[dict[str, str]]:
    """Two tiny HTTP servers answering /metrics with the real P and D captures."""
    async with contextlib.AsyncExitStack() as stack:
        yield {
            name: await stack.enter_async_context(serve(_metrics_app((FIXTURES / file).read_bytes())))
            for name, file in (("p0", "prefill_metrics.txt"), ("d0", "decode_metrics.txt"))
        }


def _dead_url() -> str:
    return closed_port_url()


def _snapshots_per_instance(factory: sessionmaker[Session]) -> dict[str, int]:
    with factory() as s:
        counts: dict[str, int] = {}
        for name in s.scalars(select(Snapshot.instance)):
            counts[name] = counts.get(name, 0) + 1
        return counts


async def test_collector_end_to_end(fake_vllm: dict[str, str], tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    upgrade(url)
    settings = parse_config(f"""
model: {{name: tiny, kv_bytes_per_token: 1024}}
pools:
  prefill: {{role: prefill, instances: [{{name: p0, url: "{fake_vllm["p0"]}"}}]}}
  decode:
    role: decode
    instances: [{{name: d0, url: "{fake_vllm["d0"]}"}}, {{name: d-dead, url: "{_dead_url()}"}}]
store: {{url: "{url}"}}
collector: {{scrape_interval_s: 0.5, scrape_timeout_s: 0.3}}
""")
    service = CollectorService(settings, port=0)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    await asyncio.wait_for(service.started.wait(), timeout=10)
    spans = request_spans(request_id="e2e-1", p="p0", d="d0")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.port}") as client:
        resp = await client.post(
            "/v1/traces", content=to_proto(spans), headers={"content-type": "application/x-protobuf"}
        )
        assert resp.status_code == 200
        # two stored rounds of every target, and the trace's spans written
        factory = session_factory(make_engine(url))
        await async_wait_until(
            "two stored scrapes of each instance",
            lambda: _snapshots_per_instance(factory),
            done=lambda n: len(n) == 3 and min(n.values()) >= 2,
        )

        async def metrics_page() -> str:
            return (await client.get("/metrics")).text

        metrics = await async_wait_until(
            "the trace's spans written",
            metrics_page,
            done=lambda text: "pdscope_collector_spans_written_total 7.0" in text,
        )
        health = (await client.get("/healthz")).json()
    stop.set()
    await asyncio.wait_for(task, timeout=10)

    assert health["status"] == "ok"
    assert 'pdscope_collector_target_up{instance="d0",pool="decode",role="decode"} 1.0' in metrics
    assert 'pdscope_collector_target_up{instance="d-dead",pool="decode",role="decode"} 0.0' in metrics
    assert "pdscope_collector_spans_written_total 7.0" in metrics
    with factory() as s:
        snaps = list(s.scalars(select(Snapshot).order_by(Snapshot.ts)))
        rec = s.scalars(select(RequestRecord)).one()
        instances = {i.name for i in s.scalars(select(InstanceRow))}
    by_inst: dict[str, list[Snapshot]] = {}
    for snap in snaps:
        by_inst.setdefault(snap.instance, []).append(snap)
    assert len(by_inst["d0"]) >= 2 and len(by_inst["p0"]) >= 2
    d0 = by_inst["d0"][-1]
    assert d0.up and d0.nixl_xfer_time_count == 23.0 and d0.requests_length == 23.0
    assert d0.histograms["vllm:nixl_xfer_time_seconds"]["counts"][-1] == 23.0
    dead = by_inst["d-dead"][-1]
    assert not dead.up and dead.error and "ConnectError" in dead.error
    assert rec.request_id == "e2e-1" and rec.d_queue_s == 0.25
    assert instances == {"p0", "d0", "d-dead"}


def test_pdscope_collect_cli_runs_and_stops(tmp_path: Path) -> None:
    from pdscope.cli import main

    cfg = tmp_path / "pdscope.yaml"
    cfg.write_text(f"""
model: {{name: tiny, kv_bytes_per_token: 1024}}
pools:
  prefill: {{role: prefill, instances: [{{name: p0, url: "{_dead_url()}"}}]}}
  decode: {{role: decode, instances: [{{name: d0, url: "{_dead_url()}"}}]}}
store: {{url: "sqlite:///{tmp_path / "cli.db"}"}}
collector: {{scrape_interval_s: 0.5, scrape_timeout_s: 0.2}}
""")
    assert main(["--config", str(cfg), "collect", "--port", "0", "--duration", "1.2"]) == 0
    factory = session_factory(make_engine(f"sqlite:///{tmp_path / 'cli.db'}"))
    with factory() as s:
        snaps = list(s.scalars(select(Snapshot)))
    assert snaps and not any(x.up for x in snaps)
