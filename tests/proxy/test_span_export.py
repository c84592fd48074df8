"""Spans survive a collector outage (issue 13 item 12) and carry the sender's token (item 7)."""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.app import build
from proxy.spanexport import OtlpHttpExporter, retry_after
from proxy.tracing import Backoff, BoundedSpanProcessor, make_provider
from tests.proxy.conftest import fake_fleet, make_settings, serve_proxy
from tests.support.serving import serve
from tests.support.sockets import bound_socket, url_of
from tests.support.waiting import async_wait_until

COMPLETION = {"model": "fake", "prompt": "a b c", "max_tokens": 4}


@dataclass
class FakeCollector:
    """An OTLP/HTTP receiver: answers ``script`` statuses in turn (then 200), keeps what it accepted."""

    script: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    span_ids: list[bytes] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)
    posts: int = 0

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/traces", self._traces, methods=["POST"])])

    async def _traces(self, request: Request) -> Response:
        self.posts += 1
        self.auth.append(request.headers.get("authorization"))
        body = await request.body()
        if self.script:
            status, headers = self.script.pop(0)
            return Response(b"", status_code=status, headers=headers)
        req = ExportTraceServiceRequest.FromString(body)
        self.span_ids += [s.span_id for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
        return Response(b"", media_type="application/x-protobuf")


async def test_a_collector_restart_loses_no_spans() -> None:
    collector = FakeCollector()
    sock = bound_socket()  # bound, not listening: connections are refused until the collector starts
    endpoint = url_of(sock)
    async with fake_fleet(1, 1) as fleet:
        settings = make_settings(
            [fleet.prefill[0].url],
            [fleet.decode[0].url],
            proxy={"otlp_endpoint": endpoint, "span_retry_max_s": 0.3},
        )
        app = build(settings)  # the real exporter
        spans = app.parts.spans
        assert spans is not None
        async with serve_proxy(app) as url, httpx.AsyncClient(timeout=10) as client:
            for _ in range(20):  # while the collector is down
                assert (await client.post(url + "/v1/completions", json=COMPLETION)).status_code == 200
            await async_wait_until("the exporter to try and fail", lambda: spans.failed > 0, timeout_s=20)
            assert spans.exported == 0 and spans.dropped == 0
            async with serve(collector.app(), sock=sock):  # the collector is back
                for _ in range(5):
                    assert (await client.post(url + "/v1/completions", json=COMPLETION)).status_code == 200
                await async_wait_until("every span exported", lambda: spans.exported == 25 * 5, timeout_s=20)
                metrics = (await client.get(url + "/metrics")).text
        assert spans.dropped == 0 and spans.rejected == 0 and spans.retries > 0
        assert len(collector.span_ids) == len(set(collector.span_ids)) == 25 * 5  # every span once
        assert "pdscope_proxy_spans_dropped_total 0.0" in metrics
        assert "pdscope_proxy_spans_export_retries_total" in metrics


class _Recorder:
    """Stands in for the export thread's pause: records it, does not wait."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, delay: float) -> bool:
        self.delays.append(delay)
        return False


async def test_429_and_503_with_retry_after_are_honoured_then_everything_arrives() -> None:
    collector = FakeCollector(script=[(429, {"Retry-After": "4"}), (503, {"Retry-After": "2"})])
    async with serve(collector.app()) as url:
        sleep = _Recorder()
        provider, proc = make_provider(
            OtlpHttpExporter(url + "/v1/traces"),
            interval_s=0.01,
            retry_base_s=0.01,
            retry_max_s=0.05,
            sleep=sleep,
        )  # type: ignore[arg-type]
        tracer = provider.get_tracer("t")
        for _ in range(7):
            tracer.start_span("s").end()
        await async_wait_until("all seven spans exported", lambda: proc.exported == 7, timeout_s=20)
        provider.shutdown()
    assert collector.posts == 3 and len(collector.span_ids) == 7
    assert sleep.delays[0] >= 4 and sleep.delays[1] >= 2  # at least what the collector asked
    assert proc.failed == 14 and proc.retries == 2 and proc.dropped == 0


async def test_a_batch_the_collector_refuses_for_good_is_counted_and_does_not_block_the_queue() -> None:
    collector = FakeCollector(script=[(400, {})])
    async with serve(collector.app()) as url:
        provider, proc = make_provider(OtlpHttpExporter(url + "/v1/traces"), interval_s=3600, max_batch=3)
        tracer = provider.get_tracer("t")
        for _ in range(6):
            tracer.start_span("s").end()
        await asyncio.to_thread(proc.force_flush)
        provider.shutdown()
    assert proc.rejected == 3 and proc.exported == 3 and len(collector.span_ids) == 3


def test_retry_after_parsing_is_bounded() -> None:
    assert retry_after("3") == 3.0
    assert retry_after(None) is None and retry_after("soon") is None
    assert retry_after("100000") == 60.0  # a collector cannot park the proxy's spans for a day
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0


def test_backoff_grows_is_jittered_and_capped() -> None:
    import random

    b = Backoff(0.2, 5.0, random.Random(1))
    delays = [b.next_delay() for _ in range(12)]
    assert 0.1 <= delays[0] <= 0.2 and max(delays) <= 5.0 and delays[-1] >= 2.5
    assert len(set(delays)) == len(delays)  # jittered
    b.reset()
    assert b.next_delay() <= 0.2
    assert b.next_delay(at_least=7.0) == 7.0


async def test_the_exporter_sends_the_bearer_token_from_the_configured_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    collector = FakeCollector()
    monkeypatch.setenv("MY_OTLP_TOKEN", "s3cret")
    monkeypatch.delenv("PDSCOPE_OTLP_TOKEN", raising=False)
    async with serve(collector.app()) as sink, fake_fleet(1, 1) as fleet:
        for token_env, expected in (("MY_OTLP_TOKEN", "Bearer s3cret"), ("PDSCOPE_OTLP_TOKEN", None)):
            collector.auth.clear()
            settings = make_settings(
                [fleet.prefill[0].url],
                [fleet.decode[0].url],
                proxy={"otlp_endpoint": sink, "otlp_token_env": token_env},
            )
            app = build(settings)
            async with serve_proxy(app) as url, httpx.AsyncClient(timeout=10) as client:
                assert (await client.post(url + "/v1/completions", json=COMPLETION)).status_code == 200
                assert app.parts.spans is not None
                await asyncio.to_thread(app.parts.spans.force_flush)
            assert collector.auth and all(a == expected for a in collector.auth), (token_env, collector.auth)


class _Flaky(SpanExporter):
    def __init__(self, fail: int) -> None:
        self.fail = fail
        self.calls = 0
        self.lock = threading.Lock()

    def export(self, spans):  # type: ignore[no-untyped-def]
        with self.lock:
            self.calls += 1
            if self.calls <= self.fail:
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def test_a_failing_collector_is_logged_when_it_starts_failing_and_when_it_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="proxy.tracing")
    exporter = _Flaky(fail=5)
    proc = BoundedSpanProcessor(exporter, interval_s=3600)
    provider, _ = make_provider(_Flaky(0), interval_s=3600)
    span = provider.get_tracer("t").start_span("s")
    span.end()
    for _ in range(3):
        proc.on_end(span)  # type: ignore[arg-type]
    for _ in range(6):  # five failed tries, then the batch goes
        proc.force_flush()
    messages = [r.getMessage() for r in caplog.records if r.name == "proxy.tracing"]
    assert len(messages) == 2 and "failing" in messages[0] and "recovered" in messages[1]
    assert proc.exported == 3 and proc.failed == 15 and proc.queued == 0
    proc.shutdown()
    provider.shutdown()
