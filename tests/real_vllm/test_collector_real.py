"""The collector against the real CPU vLLM pair: scraped values, and traces joined with vLLM's spans."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from collector.fastparse import extract_signals
from collector.otlp import SpanData
from collector.service import CollectorService
from collector.signals import from_text
from pdscope import semconv as sc
from pdscope.config import load_config
from store.db import make_engine, session_factory
from store.migrate import upgrade
from store.models import RequestRecord, Snapshot
from tests.collector.traces import to_proto
from tests.real_vllm import pd_client as pc
from tests.real_vllm.conftest import RealPD
from tests.real_vllm.prompts import unique_prompt
from tests.support.waiting import wait_until

pytestmark = pytest.mark.real_vllm


@dataclass
class Running:
    service: CollectorService
    factory: sessionmaker[Session]
    url: str


@pytest.fixture
def collector(real_pd: RealPD, tmp_path: Path) -> Iterator[Running]:
    """A real ``CollectorService`` scraping the pair every second, in a thread of its own."""
    store_url = f"sqlite:///{tmp_path / 'collector.db'}"
    upgrade(store_url)
    settings = load_config(
        real_pd.write_config(
            tmp_path / "pdscope.yaml",
            store={"url": store_url},
            collector={"scrape_interval_s": 1.0, "scrape_timeout_s": 0.9},
        )
    )
    loop = asyncio.new_event_loop()
    holder: dict[str, Any] = {}
    ready = threading.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)

        async def go() -> None:
            service = CollectorService(settings, port=0)
            stop = asyncio.Event()
            holder["service"], holder["stop"] = service, stop
            task = asyncio.create_task(service.run(stop))
            await service.started.wait()
            ready.set()
            await task

        loop.run_until_complete(go())

    thread = threading.Thread(target=main, name="collector", daemon=True)
    thread.start()
    assert ready.wait(30), "collector did not start"
    service: CollectorService = holder["service"]
    url = f"http://127.0.0.1:{service.port}"
    real_pd.otlp.forward_to = url + "/v1/traces"
    try:
        yield Running(service, session_factory(make_engine(store_url)), url)
    finally:
        real_pd.otlp.forward_to = None
        loop.call_soon_threadsafe(holder["stop"].set)
        thread.join(30)
        loop.close()


def _latest(factory: sessionmaker[Session], instance: str) -> Snapshot | None:
    with factory() as s:
        return s.scalars(
            select(Snapshot)
            .where(Snapshot.instance == instance, Snapshot.up.is_(True))
            .order_by(Snapshot.ts.desc())
            .limit(1)
        ).first()


def test_scraped_values_match_the_real_pages(real_pd: RealPD) -> None:
    """On real pages the hot path, the reference path and prometheus_client agree."""
    with httpx.Client(timeout=30) as client:
        for url in (real_pd.prefill_url, real_pd.decode_url):
            text = client.get(url + "/metrics").text
            fast, ref = extract_signals(text), from_text(text)
            assert fast.values == ref.values and fast.histograms == ref.histograms and fast.errors == []
            m = pc.parse_metrics(text)
            assert fast.values["nixl_xfer_time_count"] == m.value("vllm:nixl_xfer_time_seconds_count")
            assert fast.values["requests_length"] == m.value(
                "vllm:request_success_total", finished_reason="length"
            )
            assert fast.values["generation_tokens"] == m.value("vllm:generation_tokens_total")


def test_d_transfer_count_equals_requests_sent(real_pd: RealPD, collector: Running) -> None:
    name_p, name_d = real_pd.prefill_name, real_pd.decode_name
    before = wait_until(
        "a stored snapshot of P and of D",
        lambda: (_latest(collector.factory, name_p), _latest(collector.factory, name_d)),
        done=lambda r: r[0] is not None and r[1] is not None,
        timeout_s=30,
        every_s=0.25,
    )
    assert before[0] is not None and before[1] is not None
    p0, d0 = before
    n = 4
    with httpx.Client(timeout=120) as client:
        for i in range(n):
            body = {
                "model": real_pd.model,
                "prompt": unique_prompt(60, f"collector-{i}"),
                "max_tokens": 5,
                "temperature": 0,
            }
            _p, d = pc.two_step(client, real_pd.prefill_url, real_pd.decode_url, "completions", body)
            assert d.status == 200

    def finished(s: Snapshot) -> float:
        return (s.requests_length or 0) + (s.requests_stop or 0)

    def probe() -> tuple[Snapshot | None, Snapshot | None]:
        return _latest(collector.factory, name_d), _latest(collector.factory, name_p)

    def done(r: tuple[Snapshot | None, Snapshot | None]) -> bool:
        # P's and D's scrapes are separate: P's newest may predate its last answer when D's already counts
        # the pull (a CI run read P at 3 of 4), so both must have grown before either is held to n
        d, p = r
        return (
            d is not None
            and p is not None
            and (d.nixl_xfer_time_count or 0) - (d0.nixl_xfer_time_count or 0) >= n
            and finished(p) - finished(p0) >= n
        )

    d1, p1 = wait_until(
        f"D's stored transfer count and P's finished requests to grow by {n}",
        probe,
        done=done,
        timeout_s=30,
        every_s=0.25,
    )
    assert d1 is not None and p1 is not None
    assert (d1.nixl_xfer_time_count or 0) - (d0.nixl_xfer_time_count or 0) == n
    assert (d1.nixl_bytes_sum or 0) > (d0.nixl_bytes_sum or 0)
    assert (d1.prompt_tokens_external_kv_transfer or 0) > (d0.prompt_tokens_external_kv_transfer or 0)
    assert finished(p1) - finished(p0) == n
    assert (p1.nixl_xfer_time_count or 0) == (p0.nixl_xfer_time_count or 0)  # pull mode: P records none
    hist = d1.histograms["vllm:nixl_xfer_time_seconds"]
    assert hist["counts"][-1] == d1.nixl_xfer_time_count
    with httpx.Client(timeout=10) as client:
        text = client.get(collector.url + "/metrics").text
    assert f'pdscope_collector_target_up{{instance="{name_d}",pool="decode",role="decode"}} 1.0' in text


def _proxy_spans(
    trace_id: str, root: str, pre: str, dec: str, rid: str, real_pd: RealPD, t: dict[str, float]
) -> list[SpanData]:
    attrs = {
        sc.REQUEST_ID: rid,
        sc.ENDPOINT: "/v1/completions",
        sc.STREAM: True,
        sc.OUTCOME: "ok",
        sc.P_INSTANCE: real_pd.prefill_name,
        sc.D_INSTANCE: real_pd.decode_name,
        sc.P_POOL: "prefill",
        sc.D_POOL: "decode",
        sc.HTTP_STATUS: 200,
    }
    return [
        SpanData(trace_id, root, None, sc.SPAN_REQUEST, sc.SERVICE_PROXY, 2, t["in"], t["done"], 0, attrs),
        SpanData(
            trace_id,
            pre,
            root,
            sc.SPAN_PREFILL,
            sc.SERVICE_PROXY,
            3,
            t["p_sent"],
            t["p_done"],
            0,
            {sc.INSTANCE: real_pd.prefill_name, sc.ATTEMPT: 0},
        ),
        SpanData(
            trace_id,
            dec,
            root,
            sc.SPAN_DECODE,
            sc.SERVICE_PROXY,
            3,
            t["d_sent"],
            t["done"],
            0,
            {sc.INSTANCE: real_pd.decode_name, sc.ATTEMPT: 0},
        ),
    ]


def test_real_vllm_spans_and_proxy_spans_become_one_record(real_pd: RealPD, collector: Running) -> None:
    # The NIXL link needs a scrape of D from before the handoff: wait for the collector's first ones.
    first = wait_until(
        "a stored snapshot of D",
        lambda: _latest(collector.factory, real_pd.decode_name),
        done=lambda r: r is not None,
        timeout_s=30,
        every_s=0.25,
    )
    assert first is not None, "the collector never scraped D"
    tp = pc.make_traceparent()
    pre, dec, rid = (
        pc.make_traceparent().span_id,
        pc.make_traceparent().span_id,
        f"collector-{tp.trace_id[:8]}",
    )
    body = {
        "model": real_pd.model,
        "prompt": unique_prompt(80, "record"),
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    t: dict[str, float] = {"in": time.time()}
    with httpx.Client(timeout=120) as client:
        t["p_sent"] = time.time()
        p = pc.prefill(client, real_pd.prefill_url, "completions", body, rid, f"00-{tp.trace_id}-{pre}-01")
        t["p_done"] = t["d_sent"] = time.time()
        assert p.status == 200 and p.kv_transfer_params
        d = pc.decode(
            client,
            real_pd.decode_url,
            "completions",
            body,
            p.kv_transfer_params,
            rid,
            f"00-{tp.trace_id}-{dec}-01",
        )
        t["done"] = time.time()
    assert d.status == 200
    with httpx.Client(timeout=10) as client:
        r = client.post(
            collector.url + "/v1/traces",
            content=to_proto(_proxy_spans(tp.trace_id, tp.span_id, pre, dec, rid, real_pd, t)),
            headers={"content-type": "application/x-protobuf"},
        )
    assert r.status_code == 200

    def probe() -> RequestRecord | None:
        with collector.factory() as s:
            return s.scalars(select(RequestRecord).where(RequestRecord.request_id == rid)).first()

    rec = wait_until(
        "the request record with both queue times",
        probe,
        done=lambda r: r is not None and r.d_queue_s is not None and r.p_queue_s is not None,
        timeout_s=60,
        every_s=0.25,
    )
    assert rec is not None, "no record assembled"
    seen = {c: getattr(rec, c) for c in RequestRecord.__table__.columns.keys()}  # noqa: SIM118
    assert rec.trace_id == tp.trace_id
    assert (rec.p_instance, rec.d_instance) == (real_pd.prefill_name, real_pd.decode_name)
    for stage in ("p_queue_s", "p_prefill_s", "d_queue_s", "d_prefill_s", "d_decode_s"):
        assert getattr(rec, stage) is not None, (stage, seen)
    assert rec.completion_tokens == 8 and (rec.prompt_tokens or 0) > 50, seen
    assert rec.first_token is not None and rec.p_done is not None and rec.done is not None, seen
    assert rec.p_done <= rec.first_token <= rec.done + 0.05, seen
    assert rec.status == "ok" and rec.ttft_s is not None and rec.e2e_s is not None, seen
    assert rec.attributes["d_vllm_request_id"].startswith(f"cmpl-{rid}")
    # the forensics pass links the record to D's NIXL figures over the scrape window of its handoff
    linked = wait_until(
        "the record linked to D's NIXL figures",
        probe,
        done=lambda r: r is not None and "nixl" in (r.attributes or {}),
        timeout_s=30,
        every_s=0.25,
    )
    assert linked is not None and "nixl" in linked.attributes, linked.attributes if linked else None
    assert linked.attributes["nixl"]["d"]["nixl_xfer_time_count"] >= 1, linked.attributes
