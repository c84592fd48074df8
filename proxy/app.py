"""The proxy's ASGI application (pure ASGI: this is the hot path) and its assembly.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the P/D flow),
``GET /healthz`` (always 200 while the process serves; says which routing state is in
force, which instances outlier detection has ejected, each pool's limit in force with
its adaptive part, and the KV-aware mode with, in precise mode, the KV events subscriber's
state: a dead subscriber makes the status ``degraded``), ``GET /metrics`` (Prometheus text);
``GET /v1/models``, ``GET /health`` (``/ping``) and ``GET /version`` as vLLM answers them, and a 404
naming the route for every other (``proxy.surface``). Lifespan starts the routing poller, the
learner of what the instances serve (``proxy.models``: ``max_model_len`` for the context check,
``proxy.context``) and, in precise mode, the KV events subscriber's thread, and closes the shared
upstream client and the span exporter.

KV-aware routing (``proxy.kv_aware.mode``): :func:`build` makes the mode's cache view
(``proxy.views.make_view``) -- in precise mode over a :class:`proxy.kvindex.PrefixIndex` that a
:class:`proxy.kvsubscriber.KvEventsSubscriber` fills from every instance with a
``kv_events_endpoint``, under one lock -- or takes the ``cache_view`` it is given (a benchmark's
oracle), which then applies whatever the mode.

While a request runs, a small watcher task waits for ``http.disconnect``; if the
client goes away before the answer is complete it cancels the request task, whose
clean-up closes the upstream streams at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from prometheus_client import Counter

from pdscope.config import ConfigError, Settings
from pdscope.routing import ProxyReport
from proxy import protocol, surface
from proxy.admission import Admission
from proxy.approx import ApproxView
from proxy.concurrency import AdaptiveLimits
from proxy.context import ContextCheck
from proxy.fairqueue import FairQueue
from proxy.flow import Flow
from proxy.gate import KvRouting
from proxy.kvaware import CostModel
from proxy.kvindex import PrefixIndex
from proxy.kvsubscriber import KvEventsSubscriber, sources_of
from proxy.metrics import LiveSources, ProxyMetrics
from proxy.models import ModelCatalog, learn_forever, members_of
from proxy.outlier import OutlierDetector
from proxy.precise import PreciseView
from proxy.prefixview import CacheView
from proxy.request import FlowSettings, Gone
from proxy.routing import RoutingState, poll_forever
from proxy.selection import Policy, RetryBudget, Selector
from proxy.tenancy import Tenancy
from proxy.tokenize import Tokenizer, load_tokenizer
from proxy.tracing import BoundedSpanProcessor, make_provider, otlp_endpoint, otlp_exporter
from proxy.upstream import Upstream, UpstreamClient
from proxy.views import make_view

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_WANTED_HEADERS = (b"traceparent", b"authorization")


class _Reply:
    __slots__ = ("finished", "send", "started", "status")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False
        self.finished = False
        self.status: int | None = None

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, data: bytes, more: bool) -> None:
        if not more:
            self.finished = True
        await self.send({"type": "http.response.body", "body": data, "more_body": more})


async def _simple(
    send: Send, status: int, body: bytes, ctype: bytes = b"application/json", close: bool = False
) -> None:
    headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]
    if close:  # the rest of the request is not read: the connection cannot carry another
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


@dataclass
class Parts:
    """Everything one proxy process holds; tests reach in through ``app.parts``."""

    settings: Settings
    flow: Flow
    routing: RoutingState
    selector: Selector
    admission: Admission
    budget: RetryBudget
    metrics: ProxyMetrics
    upstream: UpstreamClient
    provider: TracerProvider | None
    spans: BoundedSpanProcessor | None
    clock: Callable[[], float]
    kv: KvRouting | None = None  # KV-aware routing, when a cache view is in use
    kv_events: KvEventsSubscriber | None = None  # precise mode's subscriber (instances with events)
    catalog: ModelCatalog = field(default_factory=ModelCatalog)  # what the instances serve (/v1/models)
    tenancy: Tenancy | None = None  # tenants on (proxy.tenancy)


class ProxyApp:
    def __init__(self, parts: Parts, poll: bool = True) -> None:
        self.parts = parts
        self.poll = poll
        self._poller: asyncio.Task[None] | None = None
        self._learner: asyncio.Task[None] | None = None
        # the request headers the flow reads: the trace's, the caller's token, and its own TTFT target
        target = parts.settings.proxy.predict.target_header.lower().encode("latin-1")
        tenant = () if parts.tenancy is None else (parts.tenancy.identify.header,)
        self._wanted = frozenset((*_WANTED_HEADERS, target, *tenant))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    # -- lifespan -----------------------------------------------------------------------

    async def startup(self) -> None:
        p = self.parts
        if p.kv_events is not None:
            p.kv_events.start()
        if self._learner is None:  # what the instances serve, asked in the background (proxy.models)
            view = p.routing
            self._learner = asyncio.create_task(
                learn_forever(
                    p.catalog,
                    lambda: members_of(view.view.prefill, view.view.decode),
                    p.settings.proxy.model_info_refresh_s,
                    p.clock,
                )
            )
        if self.poll and self._poller is None:
            urls, every_s = p.settings.controller_urls, p.settings.proxy.routing_poll_s
            self._poller = asyncio.create_task(poll_forever(p.routing, urls, every_s, p.clock, self.report))

    def report(self) -> ProxyReport:
        """What the next routing poll tells the controller. Tenants on: each tenant's requests too, and
        the scales of the tenants' weights in the last answer apply from now (none: 1)."""
        p = self.parts
        adm, tenancy = p.admission, p.tenancy
        inflight = {k: v for k, v in adm.requests.items() if v}
        if tenancy is None:
            return p.routing.report(dict(adm.demand), inflight)
        share = p.routing.current_share(p.clock())
        tenancy.scale({} if share is None else share.tenants)
        return p.routing.report(dict(adm.demand), inflight, dict(tenancy.demand))

    async def shutdown(self) -> None:
        for task in (self._poller, self._learner):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        self._poller = self._learner = None
        if self.parts.kv_events is not None:
            await asyncio.to_thread(self.parts.kv_events.stop)
        if self.parts.kv is not None:
            self.parts.kv.close()
        await self.parts.upstream.aclose()
        if self.parts.provider is not None:
            await asyncio.to_thread(self.parts.provider.shutdown)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await self.startup()
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- http ---------------------------------------------------------------------------

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        if path in protocol.ENDPOINTS:
            if method != "POST":
                await _simple(send, 405, protocol.error_body("use POST", "invalid_request_error"))
                return
            await self._proxy(path, scope, receive, send)
        elif path == "/healthz" and method == "GET":
            await _simple(send, 200, json.dumps(self.health()).encode())
        elif path == "/metrics" and method == "GET":
            await _simple(send, 200, self.parts.metrics.render(), b"text/plain; version=0.0.4; charset=utf-8")
        elif path in surface.SURFACE.get(method, ()):
            await self._surface(path, send)
        else:
            await _simple(send, 404, surface.not_served(method, path))

    async def _surface(self, path: str, send: Send) -> None:
        """``/v1/models``, ``/health`` (``/ping``), ``/version`` as vLLM answers them (``proxy.surface``)."""
        p = self.parts
        if path == "/v1/models":
            await _simple(send, 200, surface.models_body(p.catalog))
        elif path == "/version":
            await _simple(send, 200, surface.version_body(p.catalog))
        else:
            status, body = surface.health(p.routing.view, p.selector.outliers, p.catalog, p.clock())
            await _simple(send, status, body)

    def health(self) -> dict[str, object]:
        """``/healthz``: the routing state, the ejected instances, each pool's request limit in force."""
        p = self.parts
        r, now = p.routing, p.clock()
        ejected = {
            e.instance: {
                "pool": e.pool,
                "reason": e.reason,
                "remaining_s": e.remaining_s,
                "ejections": e.ejections,
            }
            for e in p.selector.outliers.ejected(now)
        }
        default = p.flow.fs.default_limits
        adaptive = p.admission.adaptive
        limits: dict[str, dict[str, int | None]] = {}
        for pool in sorted(r.view.limits):
            ceiling = r.view.limits_for(pool, default).max_inflight_requests
            limits[pool] = {
                "max_inflight_requests": ceiling,
                "adaptive_limit": None if adaptive is None else adaptive.limit(pool, ceiling),
            }
        share = r.current_share(now)
        kv_aware, degraded = self._kv_health()
        return {
            "status": "degraded" if degraded else "ok",
            "routing": r.state,
            "version": r.view.version,
            "proxy_id": r.proxy_id,
            "pid": os.getpid(),
            "share": None if share is None else {k: v.share for k, v in share.pools.items()},
            "live_proxies": None if share is None else share.live,
            "share_refused": r.share_refusal,
            "ejected": ejected,
            "pool_limits": limits,
            "kv_aware": kv_aware,
        }

    def _kv_health(self) -> tuple[dict[str, object], bool]:
        """The KV-aware mode, and in precise mode the subscriber's state; whether it is degraded
        (the subscriber's thread is not running: routing goes on, on a view that no longer learns)."""
        p = self.parts
        mode = p.settings.proxy.kv_aware.mode
        out: dict[str, object] = {"mode": mode, "view": p.kv is not None}
        sub = p.kv_events
        if sub is None:
            if mode == "precise":
                out["subscriber"] = None  # no instance has a kv_events_endpoint
            return out, False
        c = sub.counts
        out["subscriber"] = {
            "alive": sub.alive,
            "loop_errors": c.loop_errors,
            "instances": len(sub.sources),
            "stale": sorted(sub.index.stale),
        }
        return out, not sub.alive

    async def _proxy(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        # The time to receive the body is bounded by the server protocol (proxy.server), which
        # closes a connection whose request does not arrive in time: receive() then disconnects.
        chunks: list[bytes] = []
        size = 0
        limit = self.parts.settings.proxy.max_request_bytes
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            data = msg.get("body", b"")
            size += len(data)
            if size > limit:
                self.parts.metrics.request_too_large.inc()
                await _simple(
                    send,
                    413,
                    protocol.error_body(
                        f"request body over {limit} bytes (proxy.max_request_bytes)",
                        "invalid_request_error",
                        "request_too_large",
                    ),
                    close=True,
                )
                return
            chunks.append(data)
            if not msg.get("more_body", False):
                break
        raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        headers = {k: v for k, v in scope["headers"] if k in self._wanted}
        reply = _Reply(send)
        gone = Gone()
        task = asyncio.current_task()
        assert task is not None

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not reply.finished:
                gone.disconnected = True
                task.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await self.parts.flow.handle(path, raw, headers, reply, gone)
        except asyncio.CancelledError:
            if gone.disconnected and task.uncancel() == 0:
                return  # our own cancel: the client left, the flow has cleaned up
            raise
        finally:
            watcher.cancel()


def _selector(settings: Settings, policy: Policy, rng: random.Random | None) -> Selector:
    """The instance selector, with an outlier detector over every pool's instances."""
    pools = {name: [i.name for i in pool.instances] for name, pool in settings.pools.items()}
    return Selector(policy, OutlierDetector(settings.proxy.outlier, pools), rng)


def _admission(
    settings: Settings, policy: Policy, metrics: ProxyMetrics, clock: Callable[[], float]
) -> tuple[Admission, Tenancy | None]:
    """The admission gate, with the adaptive limit where it applies (it protects the weighted proxy;
    round-robin stays the toy proxy's baseline), and with tenants on their fair queue before it."""
    ps = settings.proxy
    adaptive = None
    if ps.adaptive_limit.enabled and policy == "weighted":
        ttft = settings.slo.ttft
        adaptive = AdaptiveLimits(ps.adaptive_limit, ttft.target_ms / 1000.0, ttft.percentile)
    if not settings.tenants.enabled:
        return Admission(adaptive=adaptive), None
    admission = Admission(adaptive=adaptive)
    admission.fair = FairQueue(
        settings.tenants, admission.max_waiters, clock, fleet_ttft_s=settings.slo.ttft.target_ms / 1000.0
    )
    return admission, Tenancy(settings.tenants, admission.fair, metrics.registry, clock)


def _upstream(settings: Settings, upstream_client: str) -> UpstreamClient:
    """The lean upstream client, or httpx (imported only then: benchmarks price the client)."""
    connect_s = settings.proxy.timeouts.connect_s
    if upstream_client == "httpx":
        from proxy.httpx_upstream import HttpxUpstream

        return HttpxUpstream(connect_timeout=connect_s)
    return Upstream(connect_timeout=connect_s)


def _tracing(
    settings: Settings, exporter: SpanExporter | None
) -> tuple[TracerProvider | None, BoundedSpanProcessor | None, trace.Tracer]:
    """The tracer the flow records with, and its provider and bounded span queue (None: tracing off,
    a no-op tracer). ``exporter`` None: OTLP/HTTP to the configured endpoint."""
    ps = settings.proxy
    if not ps.tracing:
        return None, None, trace.NoOpTracer()
    exporter = exporter or otlp_exporter(
        otlp_endpoint(ps.otlp_endpoint, settings.collector_url), token_env=ps.otlp_token_env
    )
    provider, spans = make_provider(
        exporter,
        max_queue=ps.span_queue_max,
        max_buffered=ps.span_queue_max,
        retry_max_s=ps.span_retry_max_s,
    )
    return provider, spans, provider.get_tracer("pdscope.proxy")


def _kv_routing(
    settings: Settings,
    metrics: ProxyMetrics,
    rng: random.Random | None,
    clock: Callable[[], float],
    cache_view: CacheView | None,
) -> tuple[CacheView | None, KvEventsSubscriber | None, KvRouting | None]:
    """The cache view KV-aware routing asks (``cache_view``, else the one ``proxy.kv_aware.mode`` names,
    else none), the KV-events subscriber feeding it, and the routing over it (None: KV-aware off)."""
    ps = settings.proxy
    kv_events: KvEventsSubscriber | None = None
    view = cache_view
    if view is None and ps.kv_aware.mode != "off":
        view, kv_events = _mode_view(settings, clock)
    # Only the precise view built here is known to key prompts safely on a worker thread.
    offload = cache_view is None and ps.kv_aware.mode == "precise"
    kv = (
        None
        if view is None
        else KvRouting(view, CostModel.from_settings(ps.kv_aware), metrics, rng, offload=offload)
    )
    return view, kv_events, kv


def build(
    settings: Settings,
    *,
    exporter: SpanExporter | None = None,
    policy: Policy | None = None,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
    poll: bool = True,
    upstream_client: str = "lean",
    cache_view: CacheView | None = None,
) -> ProxyApp:
    """Assemble a proxy from the config. ``exporter`` replaces the OTLP/HTTP one (tests);
    ``upstream_client="httpx"`` swaps the lean upstream client for httpx (benchmarks);
    ``cache_view`` is the view KV-aware routing asks, overriding ``proxy.kv_aware.mode``'s
    (a benchmark's oracle, tests' fakes); with it KV-aware routing is on whatever the mode."""
    ps = settings.proxy
    metrics = ProxyMetrics()
    routing = RoutingState(settings, clock())
    policy = policy or ps.policy
    selector = _selector(settings, policy, rng)
    admission, tenancy = _admission(settings, policy, metrics, clock)
    budget = RetryBudget(ps.retry_budget)
    upstream = _upstream(settings, upstream_client)
    provider, spans, tracer = _tracing(settings, exporter)
    view, kv_events, kv = _kv_routing(settings, metrics, rng, clock, cache_view)
    catalog, context = _context_check(settings, metrics, view)
    fs = FlowSettings.from_settings(settings)
    flow = Flow(
        fs, upstream, routing, selector, admission, budget, metrics, tracer, clock, kv, context, tenancy
    )
    trust = view.trust if isinstance(view, PreciseView | ApproxView) else None
    metrics.watch(LiveSources(routing, admission, selector, budget, spans, clock, kv_events, trust))
    parts = Parts(
        settings,
        flow,
        routing,
        selector,
        admission,
        budget,
        metrics,
        upstream,
        provider,
        spans,
        clock,
        kv,
        kv_events,
        catalog,
        tenancy,
    )
    return ProxyApp(parts, poll=poll)


def _context_check(
    settings: Settings, metrics: ProxyMetrics, view: CacheView | None
) -> tuple[ModelCatalog, ContextCheck]:
    """The catalog of what the instances serve and the context check over it, both counted in the
    proxy's metrics; the tokenizer is the precise view's when there is one (one load), else
    ``model.tokenizer``'s when set, else none (the check counts a floor)."""
    errors = Counter(
        "pdscope_proxy_model_info_errors",
        "Failed asks of an instance's GET /v1/models or /version, by instance and reason.",
        ["instance", "reason"],
        registry=metrics.registry,
    )
    refused = Counter(
        "pdscope_proxy_context_rejections",
        "Requests refused (400) before prefill: prompt and max_tokens over the model's context, by how "
        "the prompt was counted (tokenizer: exact; floor: a bound from its bytes).",
        ["counted"],
        registry=metrics.registry,
    )
    catalog = ModelCatalog(on_error=lambda inst, reason: errors.labels(inst, reason).inc())
    tokenizer: Tokenizer | None = None
    spec = settings.model.tokenizer
    if isinstance(view, PreciseView):
        tokenizer = view.tokenizer
    elif spec is not None:
        try:
            tokenizer = load_tokenizer(spec)
        except Exception as exc:  # the file's fault, said as such
            raise ConfigError([f"model.tokenizer: cannot load {spec!r}: {exc}"]) from exc
    ps = settings.proxy
    check = ContextCheck(
        catalog,
        ps.max_model_len,
        tokenizer,
        on_reject=lambda how: refused.labels(how).inc(),
        clamp=ps.max_tokens_overflow == "clamp",
    )
    return catalog, check


def _mode_view(
    settings: Settings, clock: Callable[[], float]
) -> tuple[CacheView | None, KvEventsSubscriber | None]:
    """The cache view ``proxy.kv_aware.mode`` names, and in precise mode the KV events subscriber
    that fills its index (None when no instance has a ``kv_events_endpoint``: the view then credits
    nothing, and routing is load-only in effect)."""
    kv, model = settings.proxy.kv_aware, settings.model
    common: dict[str, Any] = {
        "approx_block_chars": kv.approx_block_chars,
        "approx_chars_per_token": kv.approx_chars_per_token,
        "approx_ttl_s": kv.approx_ttl_s,
        "approx_capacity_tokens": kv.approx_capacity_tokens,
        "max_index_blocks": kv.max_index_blocks,
        "clock": clock,
    }
    if kv.mode != "precise":
        return make_view(kv.mode, **common), None
    index = PrefixIndex(model.kv_block_size, kv.max_index_blocks)
    lock = threading.Lock()  # the subscriber writes the index under it, the view reads under it
    sources = sources_of(
        {
            inst.name: (inst.kv_events_endpoint, inst.kv_events_replay_endpoint, inst.kv_events_topic)
            for _, inst in settings.instances()
        }
    )
    subscriber = KvEventsSubscriber(sources, index, lock, queue_max=kv.event_queue_max) if sources else None
    try:
        view = make_view(
            "precise", tokenizer=model.tokenizer, base_model=model.name, index=index, lock=lock, **common
        )
    except Exception as exc:  # the tokenizer could not be loaded: the file's fault, said as such
        raise ConfigError([f"model.tokenizer: cannot load {model.tokenizer!r}: {exc}"]) from exc
    return view, subscriber
