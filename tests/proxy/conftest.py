"""Fixtures for the proxy tests: a fake fleet, settings for it, a running proxy."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdscope.config import Settings, parse_config
from proxy.app import ProxyApp, build
from proxy.server import read_timeout_protocol
from tests.proxy.fakes import FakeVLLM
from tests.support.serving import serve
from tests.support.sockets import closed_port_url


@dataclass
class Fleet:
    prefill: list[FakeVLLM]
    decode: list[FakeVLLM]


@asynccontextmanager
async def fake_fleet(n_prefill: int, n_decode: int, **decode_kw: Any) -> AsyncIterator[Fleet]:
    fleet = Fleet(
        [FakeVLLM(f"p{i}", "prefill") for i in range(n_prefill)],
        [FakeVLLM(f"d{i}", "decode", **decode_kw) for i in range(n_decode)],
    )
    async with AsyncExitStack() as stack:
        for inst in (*fleet.prefill, *fleet.decode):
            inst.url = await stack.enter_async_context(serve(inst.app()))
        yield fleet


def make_settings(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    proxy: dict[str, Any] | None = None,
    kv_bytes_per_token: int = 1000,
) -> Settings:
    doc = {
        "model": {"name": "fake", "kv_bytes_per_token": kv_bytes_per_token},
        "pools": {
            "prefill": {
                "role": "prefill",
                "instances": [{"name": f"p{i}", "url": u} for i, u in enumerate(prefill_urls)],
            },
            "decode": {
                "role": "decode",
                "instances": [{"name": f"d{i}", "url": u} for i, u in enumerate(decode_urls)],
            },
        },
        "proxy": {
            "controller_url": closed_port_url(),
            "routing_poll_s": 0.05,
            "timeouts": {"connect_s": 1, "prefill_s": 5, "decode_first_token_s": 5, "decode_total_s": 10},
            **(proxy or {}),
        },
    }
    return parse_config(yaml.safe_dump(doc), "<test>")


@asynccontextmanager
async def running_proxy(
    settings: Settings, exporter: InMemorySpanExporter | None = None, **kw: Any
) -> AsyncIterator[tuple[str, ProxyApp]]:
    app = build(settings, exporter=exporter or InMemorySpanExporter(), **kw)
    async with serve_proxy(app) as url:
        yield url, app


@asynccontextmanager
async def serve_proxy(app: ProxyApp) -> AsyncIterator[str]:
    """The proxy on a free port (:func:`tests.support.serving.serve`, with more time to drain), with the
    same bounded-read server protocol ``pdscope proxy`` runs (``proxy.server``)."""
    ps = app.parts.settings.proxy
    http = read_timeout_protocol(
        ps.client_read_timeout_s, lambda phase: app.parts.metrics.client_read_timeouts.labels(phase).inc()
    )
    async with serve(app, stop_timeout_s=10, http=http) as url:
        yield url


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()
