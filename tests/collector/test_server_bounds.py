"""The collector's HTTP server: request headers within collector.header_timeout_s, and wrong OTLP
tokens counted, logged once per address and window, and throttled (429 before the token is compared)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from collector.service import CollectorService
from pdscope.config import parse_config
from store.migrate import upgrade
from tests.collector.traces import request_spans, to_proto
from tests.support.sockets import closed_port_url

GENEROUS_S = 15.0  # the bound under test is 0.5 s; closed well within this passes
GOOD = "good-token"


@pytest.fixture
async def collector(tmp_path: Path) -> AsyncIterator[CollectorService]:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    upgrade(url)
    dead = closed_port_url()
    settings = parse_config(f"""
model: {{name: tiny, kv_bytes_per_token: 1024}}
pools:
  prefill: {{role: prefill, instances: [{{name: p0, url: "{dead}"}}]}}
  decode: {{role: decode, instances: [{{name: d0, url: "{dead}"}}]}}
store: {{url: "{url}"}}
collector:
  scrape_interval_s: 5
  header_timeout_s: 0.5
  auth_throttle: {{max_failures: 2}}
""")
    service = CollectorService(settings, port=0, otlp_tokens={GOOD: "proxy"})
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        await asyncio.wait_for(service.started.wait(), timeout=10)
        yield service
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)


async def test_a_partial_request_is_closed_within_header_timeout_s(collector: CollectorService) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", collector.port)
    writer.write(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n")
    await writer.drain()
    try:
        rest = await asyncio.wait_for(reader.read(), timeout=GENEROUS_S)  # b"" once the server closes
    except TimeoutError:
        pytest.fail("the collector held a connection with unfinished headers open")
    finally:
        writer.close()
    assert rest == b""


async def test_wrong_otlp_tokens_are_throttled_counted_and_logged_once(
    collector: CollectorService, caplog: pytest.LogCaptureFixture
) -> None:
    body = to_proto(request_spans(request_id="t-1", p="p0", d="d0"))

    async def post(client: httpx.AsyncClient, token: str) -> httpx.Response:
        headers = {"content-type": "application/x-protobuf", "authorization": f"Bearer {token}"}
        return await client.post("/v1/traces", content=body, headers=headers)

    caplog.set_level(logging.WARNING, logger="pdscope.auththrottle")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{collector.port}") as client:
        for _ in range(3):  # the third is past max_failures: 2
            assert (await post(client, "guess")).status_code == 401
        r = await post(client, GOOD)  # the address is blocked: even the right token is not compared
        assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 300, r.text
        metrics = (await client.get("/metrics")).text
    assert 'pdscope_collector_auth_failures_total{reason="invalid"} 3.0' in metrics
    assert 'pdscope_collector_auth_failures_total{reason="throttled"} 1.0' in metrics
    lines = [r.getMessage() for r in caplog.records if r.name == "pdscope.auththrottle"]
    assert len(lines) == 2 and "127.0.0.1" in lines[0] and "more than 2 wrong tokens" in lines[1], lines
