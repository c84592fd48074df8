"""One client request through the proxy: admission -> prefill -> KV handoff -> decode.

This module is the chain: the body checked before anything is spent (``proxy.validate``:
what D would refuse is a 400 naming the field, and P is never called; ``proxy.context``: a
prompt and ``max_tokens`` over the model's context, the same), admission
(:class:`proxy.gate.Gate`: a P and a D pool with room, or a 429/503 naming the pool and
the reason), the prefill and decode attempts (:class:`proxy.attempts.Attempts`, which hold
the failure rules), and the full retry when D failed after it may have read P's blocks: one
new prefill (another P when there is one) and another D, within the retry budget and
through admission like every other pick.

With KV-aware routing (``proxy.gate``) the prompt is keyed once, from the body already parsed,
before admission; a request the cost model sends to D alone skips the prefill round trip
(:meth:`proxy.attempts.Attempts.decode_alone`). The root span carries the route
(``pdscope.route_path``, the predicted and reported cached tokens, the matched prefix, the
reason); the reported ones (P's and D's ``usage.prompt_tokens_details.cached_tokens``) and the
path are set whatever the mode, so records show vLLM's reuse under load-only routing too.

The client goes away: the app cancels this task; every open upstream answer is closed at
once (vLLM aborts the request) and the disconnect is counted by stage. Every stage has a
timeout (connect, prefill, decode first token, decode total). Nothing here logs per
request at INFO.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
import uuid
from collections.abc import Callable

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from pdscope import semconv as sc
from pdscope.config import DEFAULT_TENANT
from proxy import protocol
from proxy.admission import REASON_NO_INSTANCES, REASON_PREDICTED_LATE, Admission, Rejection
from proxy.attempts import CLIENT_ERROR, Attempts, Headers, upstream_error
from proxy.context import ContextCheck, token_floor
from proxy.gate import Gate, KvRouting
from proxy.metrics import ProxyMetrics
from proxy.priority import without_client_priority
from proxy.protocol import PrefillAnswer, ProtocolError
from proxy.push import SideChannels, decode_answer
from proxy.request import (
    ClientError,
    DecodeRefused,
    FlowSettings,
    Gone,
    NeedsPrefill,
    Reply,
    RequestState,
    client_error,
)
from proxy.routing import RoutingState
from proxy.selection import RetryBudget, Selector
from proxy.tenancy import Tenancy, decode_tokens, tenant_message
from proxy.tracing import head_sampled, parent_sampled, parse_traceparent
from proxy.upstream import ConnectFailed, UpstreamClient
from proxy.validate import InvalidRequest, check_body


class Flow:
    def __init__(
        self,
        fs: FlowSettings,
        upstream: UpstreamClient,
        routing: RoutingState,
        selector: Selector,
        admission: Admission,
        budget: RetryBudget,
        metrics: ProxyMetrics,
        tracer: trace.Tracer,
        clock: Callable[[], float] = time.monotonic,
        kv: KvRouting | None = None,
        context: ContextCheck | None = None,
        tenancy: Tenancy | None = None,
    ) -> None:
        self.fs, self.upstream, self.routing, self.selector = fs, upstream, routing, selector
        self.kv = kv
        self.context = context
        self.tenancy = tenancy  # tenants on: identity, limits, per-tenant counts (proxy.tenancy)
        self.admission, self.budget, self.metrics, self.tracer, self.clock = (
            admission,
            budget,
            metrics,
            tracer,
            clock,
        )
        self._rng = random.Random()
        self.outliers = selector.outliers
        self.gate = Gate(fs, routing, selector, admission, clock, kv, metrics)
        self._target_header = fs.predict.target_header.lower().encode("latin-1")
        self.attempts = Attempts(
            fs, upstream, self.gate, routing, selector, admission, budget, metrics, tracer, clock
        )
        self.peers = SideChannels()  # each P's side channel and engine id, from its answers
        self.push = fs.handoff == sc.HANDOFF_PUSH

    # -- entry ------------------------------------------------------------------------

    async def handle(
        self, endpoint: str, raw: bytes, headers: dict[bytes, bytes], reply: Reply, gone: Gone
    ) -> None:
        # A random (not cryptographic) uuid4: os.urandom is a syscall per request.
        req = RequestState(endpoint, str(uuid.UUID(int=self._rng.getrandbits(128), version=4)))
        req.started = self.clock()
        self.budget.on_request()
        incoming = headers.get(b"traceparent")
        tp_in = incoming.decode("latin-1") if incoming else None
        parent = parse_traceparent(tp_in)
        req.started_ns = time.time_ns()
        root = self.tracer.start_span(
            sc.SPAN_REQUEST, context=parent, kind=SpanKind.SERVER, start_time=req.started_ns
        )
        req.sampled = head_sampled(
            root.get_span_context().trace_id, self.fs.trace_sample_ratio, parent_sampled(parent)
        )
        if root.is_recording():
            root.set_attribute(sc.SAMPLED, req.sampled)  # before any child ends: the processor reads it
        ctx = trace.set_span_in_context(root)
        auth = headers.get(b"authorization")
        base_headers = [("X-Request-Id", req.rid)]
        if auth:
            base_headers.append(("Authorization", auth.decode("latin-1")))
        try:
            self._tenant_of(req, headers, root)
            body = self._checked_body(endpoint, raw)
            raw = self._no_client_priority(req, body, raw)
            req.stream = body.get("stream") is True
            if self.kv is not None:
                await self.gate.key_prompt(req, body, len(raw))
            exact = await self._check_context(req, body, len(raw)) if self.context is not None else None
            req.target_s = self._target_of(headers, req.tenant)
            if exact is None:
                exact = (
                    req.prompt.tokens if req.prompt is not None else prompt_tokens(endpoint, body, self.fs)
                )
            req.tokens = exact
            self._tenant_limits(req, body)
            await self._admit(req, root, ctx)
            await self._run(req, raw, body, ctx, base_headers, tp_in, reply)
        except ClientError as err:
            req.outcome = err.outcome
            if not reply.started:
                await reply.start(
                    err.status,
                    [(b"content-type", err.content_type), (b"x-request-id", req.rid.encode()), *err.headers],
                )
                await reply.body(err.body, False)
        except asyncio.CancelledError:
            if gone.disconnected:
                req.outcome = "client_disconnect"
                self.metrics.client_disconnects.labels(req.stage).inc()
            raise
        finally:
            self._settle(req)
            self._finish_root(root, req, reply.status)
            self.metrics.count_request(endpoint, req.outcome)

    def _tenant_of(self, req: RequestState, headers: dict[bytes, bytes], root: trace.Span) -> None:
        """Tenants on: the request's tenant (or a 400), on the root span whatever becomes of it."""
        if self.tenancy is not None:
            req.tenant = self.tenancy.resolve(headers)
            root.set_attribute(sc.TENANT, req.tenant)

    def _no_client_priority(self, req: RequestState, body: dict[str, object], raw: bytes) -> bytes:
        """Tenants on: the client's own ``priority`` removed (counted), never sent upstream
        (``proxy.priority``); the body's bytes as D is to get them."""
        if self.tenancy is None:
            return raw
        raw, had = without_client_priority(body, raw)
        if had:
            self.tenancy.client_priority(req.tenant)
        return raw

    def _tenant_limits(self, req: RequestState, body: dict[str, object]) -> None:
        """Tenants on: the decode tokens it is charged, and its tenant's rate and quota (or a 429)."""
        if self.tenancy is not None:
            req.decode_tokens = decode_tokens(req.endpoint, body)
            self.tenancy.check_limits(req)

    def _settle(self, req: RequestState) -> None:
        """The request is over: its tenant's counts, then everything it held given back."""
        if self.tenancy is not None:
            self.tenancy.ended(req)
        self.gate.release(req)
        if self.kv is not None:
            self.kv.settled(req)

    def _checked_body(self, endpoint: str, raw: bytes) -> dict[str, object]:
        try:
            body = protocol.parse_client_body(raw)
            check_body(endpoint, body, self.fs.max_model_len)
        except ProtocolError as exc:
            raise client_error(400, str(exc), "invalid_request_error", CLIENT_ERROR) from exc
        except InvalidRequest as exc:
            raise client_error(
                400, exc.message, "invalid_request_error", CLIENT_ERROR, "invalid_value", param=exc.param
            ) from exc
        return body

    async def _check_context(self, req: RequestState, body: dict[str, object], size: int) -> int | None:
        """A prompt and ``max_tokens`` the model's context cannot hold: a 400 before P is called.
        Returns the prompt's exact token count where the check counted it."""
        assert self.context is not None
        try:
            return await self.context.check(req.endpoint, body, size, req.prompt)
        except InvalidRequest as exc:
            raise client_error(
                400, exc.message, "invalid_request_error", CLIENT_ERROR, "invalid_value", param=exc.param
            ) from exc

    def _target_of(self, headers: dict[bytes, bytes], tenant: str) -> float:
        """The request's TTFT target in seconds: its header's (bounded), else its tenant's own (tenants
        on), else slo.ttft's."""
        raw = headers.get(self._target_header)
        ps = self.fs.predict
        if raw is None:
            fair = self.gate.admission.fair
            if fair is not None and math.isfinite(fair.target_of(tenant)):
                return fair.target_of(tenant)
            return self.fs.ttft_slo_s or ps.max_target_ms / 1000.0
        try:
            ms = float(raw.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            ms = math.nan
        if not (ps.min_target_ms <= ms <= ps.max_target_ms):
            raise client_error(
                400,
                f"header {ps.target_header}: a TTFT target in ms "
                f"from {ps.min_target_ms:g} to {ps.max_target_ms:g}",
                "invalid_request_error",
                CLIENT_ERROR,
                "invalid_value",
                param=ps.target_header,
            )
        return ms / 1000.0

    def _finish_root(self, root: trace.Span, req: RequestState, http_status: int | None) -> None:
        if root.is_recording():
            attrs: dict[str, str | int | bool | float] = {
                sc.REQUEST_ID: req.rid,
                sc.ENDPOINT: req.endpoint,
                sc.STREAM: req.stream,
                sc.OUTCOME: req.outcome,
                sc.RETRIES: req.retries,
            }
            if http_status is not None:  # what the client got (200 also for a stream that failed later)
                attrs[sc.HTTP_STATUS] = http_status
            if req.p is not None:
                attrs[sc.P_INSTANCE], attrs[sc.P_POOL] = req.p.name, req.p.pool
            if req.d is not None:
                attrs[sc.D_INSTANCE], attrs[sc.D_POOL] = req.d.name, req.d.pool
            if req.p is not None and req.d is not None:
                attrs[sc.HANDOFF] = req.handoff or self.fs.handoff
            if req.prefill is not None:
                attrs[sc.PROMPT_TOKENS] = req.prefill.prompt_tokens
                attrs[sc.KV_BLOCKS] = req.prefill.kv_blocks
                attrs[sc.KV_BYTES] = req.prefill.prompt_tokens * self.fs.kv_bytes_per_token
                if req.prefill.remote_engine_id:
                    attrs[sc.REMOTE_ENGINE_ID] = req.prefill.remote_engine_id
            if req.completion_tokens is not None:
                attrs[sc.COMPLETION_TOKENS] = req.completion_tokens
            if req.d is not None:
                self._route_attrs(attrs, req)
            if req.predicted is not None:
                self._predict_attrs(attrs, req)
            for key, ns in (
                (sc.P_SENT_NS, req.p_sent_ns),
                (sc.P_DONE_NS, req.p_done_ns),
                (sc.D_SENT_NS, req.d_sent_ns),
                (sc.FIRST_TOKEN_NS, req.first_token_ns),
            ):
                if ns is not None:
                    attrs[key] = ns
            done_ns = time.time_ns()
            keep = None if req.sampled else self._keep_reason(req, done_ns)
            if keep is not None:
                attrs[sc.KEEP] = keep
            root.set_attributes(attrs)
            if req.outcome not in ("ok", CLIENT_ERROR):  # a client's 4xx is not a server error
                root.set_status(Status(StatusCode.ERROR, req.outcome))
            root.end(end_time=done_ns)
        else:
            root.end()

    @staticmethod
    def _predict_attrs(attrs: dict[str, str | int | bool | float], req: RequestState) -> None:
        assert req.predicted is not None
        attrs[sc.PREDICTED_TTFT_S] = round(req.predicted, 6)
        attrs[sc.TTFT_TARGET_S] = req.target_s
        if req.predicted_source is not None:  # admitted (a rejection's prediction has no chosen P)
            attrs[sc.PREDICT_TOKENS_AHEAD] = req.tokens_ahead
            attrs[sc.PREDICT_TOKENS] = req.predicted_x - req.tokens_ahead
            attrs[sc.PREDICT_SOURCE] = req.predicted_source

    @staticmethod
    def _route_attrs(attrs: dict[str, str | int | bool | float], req: RequestState) -> None:
        """The route of an admitted request: its path, the view's predictions and the reason (when
        routed with a view), and the cached tokens P and D reported."""
        route = req.route
        alone = route is not None and route.p is None
        attrs[sc.ROUTE_PATH] = sc.ROUTE_DECODE_ONLY if alone else sc.ROUTE_PD
        if route is not None:
            if route.p is not None:
                attrs[sc.P_PREDICTED_CACHED] = route.p_cached
            attrs[sc.D_PREDICTED_CACHED] = route.d_cached
            attrs[sc.PREFIX_TOKENS] = route.prefix_tokens
            if route.prefix_key is not None:
                attrs[sc.PREFIX_KEY] = route.prefix_key
            attrs[sc.ROUTE_REASON] = route.reason
        elif req.route_reason is not None:
            attrs[sc.ROUTE_REASON] = req.route_reason
        if req.prefill is not None and req.prefill.cached_tokens is not None:
            attrs[sc.P_CACHED_TOKENS] = req.prefill.cached_tokens
        if req.d_cached_tokens is not None:
            attrs[sc.D_CACHED_TOKENS] = req.d_cached_tokens
        if alone and req.d_prompt_tokens is not None:  # no P answer: D's usage counts the prompt
            attrs[sc.PROMPT_TOKENS] = req.d_prompt_tokens

    def _keep_reason(self, req: RequestState, done_ns: int) -> str | None:
        """Why an unsampled request's child spans are kept anyway, or None: it failed, an attempt of
        it failed (it was retried: the collector's forensics reads the failed attempts' spans), or the
        proxy saw it miss the TTFT SLO (its first token late, or none by the time it ended; a client's
        own mistake excepted)."""
        if req.outcome in ("error", "timeout"):
            return sc.KEEP_FAILED
        if req.retries:
            return sc.KEEP_RETRIED
        target = self.fs.ttft_slo_s
        if target is None or req.outcome == CLIENT_ERROR:
            return None
        until = req.first_token_ns if req.first_token_ns is not None else done_ns
        return sc.KEEP_SLOW if (until - req.started_ns) / 1e9 > target else None

    # -- admission ----------------------------------------------------------------------

    async def _admit(self, req: RequestState, root: trace.Span, ctx: Context) -> None:
        span = self.tracer.start_span(sc.SPAN_ADMISSION, context=ctx)
        began = self.clock()
        try:
            rejection = await self.gate.admit(req)
            if rejection is not None:
                if self.tenancy is not None:
                    self.tenancy.rejected(req.tenant, rejection.reason)
                raise self._rejected(rejection, span, root, req.tenant)
            if self.tenancy is not None:
                self.tenancy.admitted(req, self.clock() - began)
        finally:
            span.end()

    def _rejected(
        self, rejection: Rejection, span: trace.Span, root: trace.Span, tenant: str = DEFAULT_TENANT
    ) -> ClientError:
        for pool in rejection.pools:
            self.metrics.rejections.labels(pool, rejection.reason).inc()
        span.set_attribute(sc.REJECT_REASON, rejection.reason)
        root.set_attribute(sc.REJECT_REASON, rejection.reason)
        wait = self.fs.retry_after_s
        if rejection.retry_after_s is not None:  # predicted_late: when a request like it would make it
            wait = min(max(math.ceil(rejection.retry_after_s), 1), 3600)
        retry_after = [(b"retry-after", str(wait).encode())]
        if rejection.reason == REASON_PREDICTED_LATE:
            return client_error(
                429,
                f"no prefill instance can give a first token within the target now; retry in {wait} s",
                "rate_limit_error",
                "rejected",
                rejection.reason,
                retry_after,
            )
        if rejection.reason == REASON_NO_INSTANCES:
            return client_error(
                503,
                f"no routable {rejection.role} instance (all drained or weight 0)",
                "service_unavailable",
                "rejected",
                rejection.reason,
                retry_after,
            )
        return client_error(
            429,
            tenant_message(rejection.reason, tenant)
            or f"pool {rejection.pools[0]!r} is at its limit ({rejection.reason}); retry later",
            "rate_limit_error",
            "rejected",
            rejection.reason,
            retry_after,
        )

    # -- prefill then decode, with the full retry ------------------------------------------

    async def _run(
        self,
        req: RequestState,
        raw: bytes,
        body: dict[str, object],
        ctx: Context,
        base: Headers,
        tp_in: str | None,
        reply: Reply,
    ) -> None:
        if req.p is None:  # the cost model sent it to D alone
            await self.attempts.decode_alone(req, raw, ctx, base, tp_in, reply)
            return
        p_body = json.dumps(protocol.prefill_body(body)).encode()
        tried_d: list[str] = []
        full_retries = 0
        while True:
            early = self._early_leg(req, raw, body, ctx, base, tp_in, reply)
            try:
                answer = await self.attempts.prefill(req, p_body, ctx, base, tp_in)
            except BaseException:
                await self._drop_early(req, early, "cancelled")
                raise
            try:
                if not await self._kept_early(req, answer, early, tried_d):
                    d_answer = decode_answer(answer) if self.push else answer
                    await self.attempts.decode(req, raw, body, d_answer, ctx, base, tp_in, reply, tried_d)
                return
            except NeedsPrefill as exc:
                self._full_retry(req, exc, tried_d, full_retries)
                full_retries += 1

    # -- push mode: D's leg with P's (proxy.push) ------------------------------------------

    def _early_leg(
        self,
        req: RequestState,
        raw: bytes,
        body: dict[str, object],
        ctx: Context,
        base: Headers,
        tp_in: str | None,
        reply: Reply,
    ) -> tuple[asyncio.Task[None], str] | None:
        """Push mode, P's side channel known: D's leg, started now (with the engine it registers with)."""
        if not self.push or not self.fs.push_early or req.p is None:
            return None
        peer = self.peers.get(req.p.name)
        if peer is None:
            return None
        d_body = protocol.decode_bytes(raw, body, peer.decode_params(req.rid))
        task = asyncio.create_task(self.attempts.decode_early(req, d_body, ctx, base, tp_in, reply))
        return task, peer.engine_id

    async def _kept_early(
        self,
        req: RequestState,
        answer: PrefillAnswer,
        early: tuple[asyncio.Task[None], str] | None,
        tried_d: list[str],
    ) -> bool:
        """P answered: learn its side channel; then the early leg served the request (True), or there is
        none, or it is void (another engine answered; D goes again with P's answer), or D failed before
        anything reached it (moved to another D). Raises what the early leg's failure calls for."""
        assert req.p is not None
        if self.peers.learn(req.p.name, answer.kv_transfer_params):
            self.metrics.engine_changes.labels(req.p.name).inc()
        if not self.push:
            return False
        req.handoff = sc.HANDOFF_PUSH
        if early is None:
            return False
        task, engine = early
        if answer.remote_engine_id != engine and not req.first_token_ns:
            await self._drop_early(req, early, "void")
            return False
        self.metrics.push_early.labels("kept").inc()
        req.handoff = sc.HANDOFF_PUSH_EARLY
        assert req.d is not None
        d = req.d
        self.gate.hold_kv(req, answer.prompt_tokens * self.fs.kv_bytes_per_token)
        try:
            await task
            return True
        except (ConnectFailed, DecodeRefused, NeedsPrefill) as exc:
            self.attempts.early_failed(req, d, exc, tried_d)
            req.handoff = sc.HANDOFF_PUSH
            return False

    async def _drop_early(
        self, req: RequestState, early: tuple[asyncio.Task[None], str] | None, why: str
    ) -> None:
        """Cancel an early leg that no longer counts; its D sent time goes with it (a P failure is P's)."""
        if early is None:
            return
        task = early[0]
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        req.d_sent_ns = None
        self.metrics.push_early.labels(why).inc()

    def _full_retry(self, req: RequestState, exc: NeedsPrefill, tried_d: list[str], done: int) -> None:
        """Move ``req`` to another D and (when there is one) another P for a new prefill, or end it."""
        self.gate.drop_kv(req)
        assert req.d is not None and req.p is not None
        tried_d.append(req.d.name)
        d = self.gate.retry(
            req,
            "decode",
            tried_d,
            spend=lambda: done < self.fs.max_full_retries and self.attempts.spend("full"),
        )
        if d is None:
            raise upstream_error("decode", exc.kind) from exc
        # Another P when there is one: the failed handoff may be this P's (or this pair's).
        if self.gate.retry(req, "prefill", (req.p.name,), spend=lambda: True, or_same=True) is None:
            raise upstream_error("decode", exc.kind) from exc  # no P pool has room for the new prefill
        req.retries += 1


def prompt_tokens(endpoint: str, body: dict[str, object], fs: FlowSettings) -> int:
    """The predictor's count of a prompt no KV view keyed: its text at ``chars_per_token`` (token ids
    count one each); 0 when unknown."""
    return token_floor(endpoint, body, fs.predict.chars_per_token) or 0
