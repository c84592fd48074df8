"""An in-memory fleet for the proxy's flow: no sockets, no server, the failure rules alone.

:class:`MemoryUpstream` is a :class:`proxy.upstream.UpstreamClient` that hands each call to
a :class:`MemVLLM` by its URL. A ``MemVLLM`` answers exactly as :class:`tests.proxy.fakes.FakeVLLM`
does over HTTP (same modes, same bodies, same streams), plus ``down`` (the connection is
refused) and ``hang`` bounded by the caller's ``within_s`` (an upstream timeout), and it
records each call. :func:`memory_flow` builds the proxy's parts from a config (as
``proxy.app.build`` does) around a ``MemoryUpstream``; :class:`RecordingReply` is where the
answer goes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import yaml
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdscope.config import Settings, parse_config
from proxy.app import Parts, build
from proxy.flow import Flow
from proxy.prefixview import CacheView
from proxy.request import Gone
from proxy.tracing import BoundedSpanProcessor, make_provider
from proxy.upstream import ConnectFailed, UpstreamTimeout
from tests.proxy.fakes import FakeVLLM

COMPLETION = {"model": "fake", "prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0}


@dataclass
class MemVLLM(FakeVLLM):
    """``mode`` as FakeVLLM's, plus ``down``; ``entered`` is set by every call that reaches it."""

    entered: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.url = self.url or f"http://{self.name}.mem"


class MemResponse:
    def __init__(
        self, status: int, content_type: bytes, body: bytes = b"", stream: AsyncIterator[bytes] | None = None
    ) -> None:
        self.status = status
        self._headers = {b"content-type": content_type}
        self._body = body
        self._stream = stream
        self.closed = False

    def header(self, name: bytes) -> bytes | None:
        return self._headers.get(name.lower())

    async def next_chunk(self) -> bytes | None:
        if self._stream is None:
            body, self._body = self._body, b""
            return body or None
        try:
            return await self._stream.__anext__()
        except StopAsyncIteration:
            self._stream = None
            return None

    async def read(self) -> bytes:
        parts = []
        while (chunk := await self.next_chunk()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        """Closes a stream not read to its end (the instance counts it as aborted), as a socket close
        would."""
        self.closed = True
        stream, self._stream = self._stream, None
        if stream is not None and not getattr(
            stream, "ag_running", False
        ):  # running: its reader is cancelled
            closing = stream.aclose()  # type: ignore[attr-defined]
            try:  # the fakes' streams close without awaiting: one step ends it
                closing.send(None)
            except StopIteration:
                pass
            else:
                closing.close()
                raise AssertionError("a fake stream awaited while it was being closed")

    async def __aenter__(self) -> MemResponse:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class MemoryUpstream:
    def __init__(self, instances: Iterable[MemVLLM]) -> None:
        self.by_url = {i.url: i for i in instances}

    async def post(
        self,
        base_url: str,
        path: str,
        body: bytes,
        headers: Iterable[tuple[str, str]] = (),
        *,
        within_s: float,
    ) -> MemResponse:
        inst = self.by_url.get(base_url)
        if inst is None or inst.mode == "down":
            raise ConnectFailed(f"connection refused: {base_url}")
        doc = json.loads(body)
        hdrs = {k.lower(): v for k, v in headers}
        inst.calls.append({"path": path, "headers": hdrs, "body": doc})
        inst.entered.set()
        if inst.mode == "hang":
            try:
                await asyncio.wait_for(asyncio.Event().wait(), within_s)
            except TimeoutError:
                raise UpstreamTimeout(f"no answer within {within_s}s") from None
        rid = hdrs.get("x-request-id", "none")
        status, payload = inst.answer(rid, doc)
        if payload is None:
            return MemResponse(200, b"text/event-stream", stream=inst.events(rid, doc))
        return MemResponse(status, b"application/json", json.dumps(payload).encode())

    async def aclose(self) -> None:
        pass


class RecordingReply:
    """What the client got: status, headers, the body, and whether it ended."""

    def __init__(self) -> None:
        self.started = False
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.ended = False

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        assert not self.started, "started twice"
        self.started, self.status, self.headers = True, status, headers

    async def body(self, data: bytes, more: bool) -> None:
        assert self.started and not self.ended, "body outside start..end"
        self.chunks.append(data)
        self.ended = not more

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)

    def json(self) -> Any:
        return json.loads(self.data)


def memory_settings(
    pools: dict[str, tuple[str, Sequence[MemVLLM]]],
    proxy: dict[str, Any] | None = None,
    pool_weights: dict[str, float] | None = None,
) -> Settings:
    """A config whose pools (name -> (role, instances)) hold the in-memory instances."""
    doc = {
        "model": {"name": "fake", "kv_bytes_per_token": 1000},
        "pools": {
            name: {
                "role": role,
                "weight": (pool_weights or {}).get(name, 1.0),
                "instances": [{"name": i.name, "url": i.url} for i in insts],
            }
            for name, (role, insts) in pools.items()
        },
        "proxy": {
            "controller_url": "http://controller.mem",
            "tracing": False,
            "timeouts": {"connect_s": 1, "prefill_s": 5, "decode_first_token_s": 5, "decode_total_s": 10},
            **(proxy or {}),
        },
    }
    return parse_config(yaml.safe_dump(doc), "<memory>")


@dataclass
class MemoryProxy:
    flow: Flow
    parts: Parts
    upstream: MemoryUpstream
    processor: BoundedSpanProcessor | None = None  # with memory_flow(..., bounded=True)

    async def send(
        self,
        body: dict[str, Any] | None = None,
        endpoint: str = "/v1/completions",
        headers: dict[bytes, bytes] | None = None,
    ) -> RecordingReply:
        reply = RecordingReply()
        await self.flow.handle(
            endpoint, json.dumps(body or COMPLETION).encode(), headers or {}, reply, Gone()
        )
        return reply

    def metric(self, name: str, **labels: str) -> float:
        """A sample of the proxy's registry (0 when the series does not exist yet)."""
        return self.parts.metrics.registry.get_sample_value(name, labels) or 0.0


def memory_flow(
    settings: Settings,
    instances: Iterable[MemVLLM],
    spans: InMemorySpanExporter | None = None,
    bounded: bool = False,
    cache_view: CacheView | None = None,
) -> MemoryProxy:
    """The proxy's flow and parts from ``settings``, with its upstream calls going to ``instances``;
    with ``spans`` every span ends up there as it ends (no tracing otherwise). ``bounded``: through
    the proxy's own provider and processor instead (``proxy.tracing``: sampling applies; spans
    arrive on ``processor.force_flush()``; shut it down at the end). ``cache_view``: KV-aware routing
    on, asking this view (as ``build(cache_view=...)``)."""
    parts = build(settings, poll=False, cache_view=cache_view).parts
    upstream = MemoryUpstream(instances)
    tracer: trace.Tracer = trace.NoOpTracer()
    processor: BoundedSpanProcessor | None = None
    if spans is not None and bounded:
        provider, processor = make_provider(spans, interval_s=3600.0)
        tracer = provider.get_tracer("tests.proxy.memory")
    elif spans is not None:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(spans))
        tracer = provider.get_tracer("tests.proxy.memory")
    flow = Flow(
        parts.flow.fs,
        upstream,
        parts.routing,
        parts.selector,
        parts.admission,
        parts.budget,
        parts.metrics,
        tracer,
        parts.clock,
        parts.kv,
        tenancy=parts.tenancy,
    )
    return MemoryProxy(flow, parts, upstream, processor)


def one_pool_each(
    prefill: Sequence[MemVLLM],
    decode: Sequence[MemVLLM],
    spans: InMemorySpanExporter | None = None,
    **proxy: object,
) -> MemoryProxy:
    """Pools ``prefill`` and ``decode`` holding these instances; ``proxy`` are the config's proxy settings."""
    settings = memory_settings({"prefill": ("prefill", prefill), "decode": ("decode", decode)}, proxy=proxy)
    return memory_flow(settings, [*prefill, *decode], spans)
