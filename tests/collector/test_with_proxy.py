"""Simulated fleet + the real ``pdscope proxy`` + the collector: proxy traces become request records."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from collector.service import CollectorService
from pdscope.config import parse_config
from pdscope.semconv import SERVICE_PROXY, SPAN_REQUEST
from store.db import make_engine, session_factory
from store.migrate import upgrade
from store.models import RequestRecord, SpanRow
from tests.support.sockets import free_ports
from tests.support.waiting import async_wait_until

running_fleet = pytest.importorskip("simulator.testing").running_fleet
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("ratio", [1.0, 0.0])
async def test_proxy_traces_become_records(tmp_path: Path, ratio: float) -> None:
    """Every request gets its record; at ratio 0 from the proxy's root span alone (its children stay in
    the proxy), with the same stage columns."""
    with running_fleet(n_prefill=1, n_decode=2, seed=3, latency_scale=0.05) as fleet:
        store_url = f"sqlite:///{tmp_path / 'e2e.db'}"
        upgrade(store_url)
        proxy_port, ctl_port = free_ports(2)
        cfg_text = fleet.config_yaml(
            store={"url": store_url},
            collector={"scrape_interval_s": 0.5, "scrape_timeout_s": 0.4},
            proxy={
                "port": proxy_port,
                "controller_url": f"http://127.0.0.1:{ctl_port}",
                "trace_sample_ratio": ratio,
            },
        )
        settings = parse_config(cfg_text)
        service = CollectorService(settings, port=0)
        cfg = tmp_path / "pdscope.yaml"
        cfg.write_text(cfg_text)
        stop = asyncio.Event()
        task = asyncio.create_task(service.run(stop))
        await asyncio.wait_for(service.started.wait(), 10)
        env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "200"}
        log_path = tmp_path / "proxy.log"
        log_file = log_path.open("wb")
        proxy = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "pdscope.cli",
            "--config",
            str(cfg),
            "proxy",
            "--otlp-endpoint",
            f"http://127.0.0.1:{service.port}/v1/traces",
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=log_file,
        )
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{proxy_port}", timeout=30) as client:
                await async_wait_until(
                    "the proxy to answer /healthz",
                    lambda: client.get("/healthz"),
                    done=lambda r: r.status_code < 500,
                    every_s=0.1,
                    ignore=(httpx.HTTPError,),
                )
                n = 6
                for i in range(n):
                    r = await client.post(
                        "/v1/completions",
                        json={
                            "model": fleet.model_name,
                            "prompt": f"request {i} " + "word " * 30,
                            "max_tokens": 5,
                            "stream": i % 2 == 0,
                        },
                    )
                    assert r.status_code == 200, r.text
            factory = session_factory(make_engine(store_url))

            def stored() -> list[RequestRecord]:
                with factory() as s:
                    return list(s.scalars(select(RequestRecord)))

            records = await async_wait_until(
                f"{n} request records", stored, done=lambda rs: len(rs) >= n, every_s=0.1
            )
            with factory() as s:
                proxy_spans = list(s.scalars(select(SpanRow.name).where(SpanRow.service == SERVICE_PROXY)))
        finally:
            proxy.terminate()
            try:
                await asyncio.wait_for(proxy.wait(), timeout=10)
            except TimeoutError:
                proxy.kill()
                await proxy.wait()
            log_file.close()
            proxy_log = log_path.read_text(errors="replace")[-2000:]
            stop.set()
            await asyncio.wait_for(task, timeout=15)
    assert len(records) == n, proxy_log
    for rec in records:
        assert rec.status == "ok"
        assert rec.p_instance == "prefill-0" and rec.d_instance in ("decode-0", "decode-1")
        assert rec.p_sent is not None and rec.p_done is not None and rec.d_sent is not None
        assert rec.first_token is not None and rec.done is not None
        assert rec.proxy_in <= rec.p_sent <= rec.p_done <= rec.first_token <= rec.done
        assert rec.ttft_s is not None and rec.e2e_s is not None and rec.slo_met is not None
        assert rec.prompt_tokens is not None and rec.prompt_tokens > 0
    # D reports usage on whole responses; a stream carries it only when the client asks
    assert {r.completion_tokens for r in records if not r.stream} == {5}
    if ratio == 0.0:  # the children never left the proxy: each record was built from its root alone
        assert proxy_spans == [SPAN_REQUEST] * n
    else:
        assert proxy_spans.count(SPAN_REQUEST) == n and len(proxy_spans) > n
