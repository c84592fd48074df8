"""One client request through the proxy: admission -> prefill -> KV handoff -> decode.

Failure rules (why: P's pinned KV blocks are meant to be read once, by one D):
- P fails or times out: count it against P (``proxy.outlier``: consecutive and windowed
  failures eject an instance for a while, and weigh it down in selection), retry on
  another P if the retry budget allows.
- D cannot be connected to, or answers 503 (vLLM refuses before scheduling: queue
  limits, engine dead): it never started the NIXL read, so P's blocks are unread and
  another D may pull them -- retry on another D with the same ``kv_transfer_params``.
- D accepted the request and then failed or timed out before its first token: it may
  have started (or finished) the NIXL read, and P's blocks may be freed, so a retry
  needs a new prefill: one full retry (new prefill, another D) within the budget.
- D answers 200 and its stream's first event is its own ``data: {"error": ...}`` (a failed
  NIXL read, say), or the stream ends before any event: a decode failure before the first
  token, with the rule above (new prefill, another D, a counted failure).
- After the first byte went to the client: no retry; a streamed answer ends with an
  OpenAI-style ``data: {"error": ...}`` event (D's own in-band error is forwarded as it
  is), and so does a stream that ends without ``[DONE]``; the outcome is ``error``
  (``timeout`` past ``decode_total_s``) and the failure is counted against D.
- The body is checked before anything is spent (``proxy.validate``): what D would refuse
  is a 400 naming the field, and P is never called. A 4xx that P or D still answers is the
  client's problem: passed through unchanged, never retried, never counted against the
  instance (not an outlier failure, no failure metric); the outcome is ``client_error``.
- Successes count too (P answered; D's answer complete), so the outlier window holds a
  failure *ratio*. Each success's latency (P: the prefill call; D: admission to first
  token) is a sample for the pool's adaptive limit (``proxy.concurrency``), and so is a
  timeout.
- The client goes away: the app cancels this task; every open upstream answer is closed
  at once (vLLM aborts the request) and the disconnect is counted by stage.

Every stage has a timeout (connect, prefill, decode first token, decode total).
Nothing here logs per request at INFO.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Callable

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from pdscope import semconv as sc
from proxy import protocol
from proxy.admission import REASON_NO_INSTANCES, REASON_QUEUE_FULL, Admission, Rejection
from proxy.metrics import ProxyMetrics
from proxy.protocol import PrefillAnswer, ProtocolError, SseWatch
from proxy.request import (
    JSON,
    ClientError,
    DecodeRefused,
    FlowSettings,
    Gone,
    NeedsPrefill,
    Reply,
    RequestState,
    client_error,
)
from proxy.routing import RoutingState, RoutingView, Target
from proxy.selection import RetryBudget, Selector
from proxy.tracing import parse_traceparent, traceparent
from proxy.upstream import ConnectFailed, UpstreamClient, UpstreamError, UpstreamResponse, UpstreamTimeout
from proxy.validate import InvalidRequest, check_body

CLIENT_ERROR = sc.OUTCOME_CLIENT_ERROR
_FIRST_EVENT_MAX = 1 << 20  # bytes read while waiting for D's first complete event


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
    ) -> None:
        self.fs, self.upstream, self.routing, self.selector = fs, upstream, routing, selector
        self.admission, self.budget, self.metrics, self.tracer, self.clock = (
            admission, budget, metrics, tracer, clock,
        )
        self._rng = random.Random()
        self.outliers = selector.outliers

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
        root = self.tracer.start_span(sc.SPAN_REQUEST, context=parse_traceparent(tp_in), kind=SpanKind.SERVER)
        ctx = trace.set_span_in_context(root)
        auth = headers.get(b"authorization")
        base_headers = [("X-Request-Id", req.rid)]
        if auth:
            base_headers.append(("Authorization", auth.decode("latin-1")))
        try:
            try:
                body = protocol.parse_client_body(raw)
                check_body(endpoint, body, self.fs.max_model_len)
            except ProtocolError as exc:
                raise client_error(400, str(exc), "invalid_request_error", CLIENT_ERROR) from exc
            except InvalidRequest as exc:
                raise client_error(400, exc.message, "invalid_request_error", CLIENT_ERROR,
                                   "invalid_value", param=exc.param) from exc
            req.stream = body.get("stream") is True
            await self._admit(req, root, ctx)
            await self._run(req, body, ctx, base_headers, tp_in, reply)
        except ClientError as err:
            req.outcome = err.outcome
            if not reply.started:
                await reply.start(err.status, [(b"content-type", err.content_type),
                                               (b"x-request-id", req.rid.encode()), *err.headers])
                await reply.body(err.body, False)
        except asyncio.CancelledError:
            if gone.disconnected:
                req.outcome = "client_disconnect"
                self.metrics.client_disconnects.labels(req.stage).inc()
            raise
        finally:
            self._release(req)
            self._finish_root(root, req, reply.status)
            self.metrics.count_request(endpoint, req.outcome)

    def _finish_root(self, root: trace.Span, req: RequestState, http_status: int | None) -> None:
        if root.is_recording():
            attrs: dict[str, str | int | bool] = {
                sc.REQUEST_ID: req.rid, sc.ENDPOINT: req.endpoint, sc.STREAM: req.stream,
                sc.OUTCOME: req.outcome, sc.RETRIES: req.retries,
            }
            if http_status is not None:  # what the client got (200 also for a stream that failed later)
                attrs[sc.HTTP_STATUS] = http_status
            if req.p is not None:
                attrs[sc.P_INSTANCE], attrs[sc.P_POOL] = req.p.name, req.p.pool
            if req.d is not None:
                attrs[sc.D_INSTANCE], attrs[sc.D_POOL] = req.d.name, req.d.pool
            if req.prefill is not None:
                attrs[sc.PROMPT_TOKENS] = req.prefill.prompt_tokens
                attrs[sc.KV_BLOCKS] = req.prefill.kv_blocks
                attrs[sc.KV_BYTES] = req.prefill.prompt_tokens * self.fs.kv_bytes_per_token
                if req.prefill.remote_engine_id:
                    attrs[sc.REMOTE_ENGINE_ID] = req.prefill.remote_engine_id
            if req.completion_tokens is not None:
                attrs[sc.COMPLETION_TOKENS] = req.completion_tokens
            root.set_attributes(attrs)
            if req.outcome not in ("ok", CLIENT_ERROR):  # a client's 4xx is not a server error
                root.set_status(Status(StatusCode.ERROR, req.outcome))
        root.end()

    # -- admission ----------------------------------------------------------------------

    async def _admit(self, req: RequestState, root: trace.Span, ctx: object) -> None:
        span = self.tracer.start_span(sc.SPAN_ADMISSION, context=ctx)  # type: ignore[arg-type]
        try:
            deadline = self.clock() + self.routing.view.queue_wait_s(self.fs.queue_timeout_s)
            while True:
                rejection = self._try_admit(req, self.routing.view, self.clock())
                if rejection is None:
                    return
                if rejection.reason == REASON_NO_INSTANCES:
                    break
                remaining = deadline - self.clock()
                if remaining <= 0:
                    break
                if not self.admission.can_wait():
                    rejection = Rejection(REASON_QUEUE_FULL, rejection.pool)
                    break
                await self.admission.wait(remaining)
            self.metrics.rejections.labels(rejection.pool, rejection.reason).inc()
            span.set_attribute(sc.REJECT_REASON, rejection.reason)
            root.set_attribute(sc.REJECT_REASON, rejection.reason)
            retry_after = [(b"retry-after", str(self.fs.retry_after_s).encode())]
            if rejection.reason == REASON_NO_INSTANCES:
                raise client_error(503, f"no routable {rejection.pool} instance (all drained or weight 0)",
                           "service_unavailable", "rejected", rejection.reason, retry_after)
            raise client_error(429, f"pool {rejection.pool!r} is at its limit ({rejection.reason}); retry later",
                       "rate_limit_error", "rejected", rejection.reason, retry_after)
        finally:
            span.end()

    def _try_admit(self, req: RequestState, view: RoutingView, now: float) -> Rejection | None:
        if not view.prefill:
            return Rejection(REASON_NO_INSTANCES, "prefill")
        if not view.decode:
            return Rejection(REASON_NO_INSTANCES, "decode")
        p_pools, p_why = self._open_pools(view, view.prefill_pools)
        if not p_pools:
            return p_why
        d_pools, d_why = self._open_pools(view, view.decode_pools)
        if not d_pools:
            return d_why
        p = self.selector.pick("prefill", view.prefill, now, pools=p_pools)
        d = self.selector.pick("decode", view.decode, now, pools=d_pools)
        assert p is not None and d is not None
        req.p, req.d = p, d
        req.admitted = now
        self.admission.enter(p.pool)
        req.p_slot = p.pool
        self.admission.enter(d.pool)
        req.d_slot = d.pool
        return None

    def _open_pools(self, view: RoutingView, pools: tuple[str, ...]) -> tuple[list[str], Rejection | None]:
        open_, why = [], None
        for pool in pools:
            reason = self.admission.blocked(pool, view.limits_for(pool, self.fs.default_limits))
            if reason is None:
                open_.append(pool)
            elif why is None:
                why = Rejection(reason, pool)
        return open_, why

    def _release(self, req: RequestState) -> None:
        self._drop_kv(req)
        if req.p_slot is not None:
            self.admission.leave(req.p_slot)
            req.p_slot = None
        if req.d_slot is not None:
            self.admission.leave(req.d_slot)
            req.d_slot = None

    def _drop_kv(self, req: RequestState) -> None:
        if req.kv_held is not None:
            p_pool, d_pool, n = req.kv_held
            req.kv_held = None
            self.admission.remove_bytes(p_pool, n)
            self.admission.remove_bytes(d_pool, n)

    def _move_slot(self, old: str | None, new: str) -> str:
        if old != new:
            if old is not None:
                self.admission.leave(old)
            self.admission.enter(new)
        return new

    # -- prefill then decode, with the full-retry loop ---------------------------------------

    async def _run(
        self, req: RequestState, body: dict[str, object], ctx: object, base: list[tuple[str, str]],
        tp_in: str | None, reply: Reply,
    ) -> None:
        p_body = json.dumps(protocol.prefill_body(body)).encode()
        tried_d: list[str] = []
        full_retries = 0
        while True:
            answer = await self._prefill(req, p_body, ctx, base, tp_in)
            try:
                await self._decode(req, body, answer, ctx, base, tp_in, reply, tried_d)
                return
            except NeedsPrefill as exc:
                self._drop_kv(req)
                assert req.d is not None
                tried_d.append(req.d.name)
                nxt = self.selector.pick("decode", self.routing.view.decode, self.clock(), exclude=tried_d)
                if full_retries >= self.fs.max_full_retries or nxt is None or not self._spend("full"):
                    raise self._upstream_error("decode", exc.kind) from exc
                full_retries += 1
                req.retries += 1
                req.d = nxt
                req.d_slot = self._move_slot(req.d_slot, nxt.pool)
                assert req.p is not None
                # Another P when there is one: the failed handoff may be this P's (or this pair's).
                req.p = self.selector.pick("prefill", self.routing.view.prefill, self.clock(),
                                           exclude=(req.p.name,)) or req.p
                req.p_slot = self._move_slot(req.p_slot, req.p.pool)

    def _sample(self, pool: str, seconds: float, now: float) -> None:
        """A latency sample for ``pool``'s adaptive limit (when it is on)."""
        adaptive = self.admission.adaptive
        if adaptive is not None:
            ceiling = self.routing.view.limits_for(pool, self.fs.default_limits).max_inflight_requests
            adaptive.observe(pool, seconds, self.admission.requests[pool], ceiling, now)

    def _spend(self, stage: str) -> bool:
        if self.budget.try_spend():
            self.metrics.retries.labels(stage).inc()
            return True
        self.metrics.retries_refused.labels(stage).inc()
        return False

    def _upstream_error(self, stage: str, kind: str) -> ClientError:
        if kind == "timeout":
            return client_error(504, f"{stage} timed out", "timeout_error", "timeout", "upstream_timeout")
        return client_error(502, f"{stage} failed ({kind})", "upstream_error", "error", "upstream_" + kind)

    def _headers(self, base: list[tuple[str, str]], span: trace.Span, tp_in: str | None) -> list[tuple[str, str]]:
        tp = traceparent(span) or tp_in
        return [*base, ("traceparent", tp)] if tp else base

    async def _prefill(
        self, req: RequestState, p_body: bytes, ctx: object, base: list[tuple[str, str]], tp_in: str | None
    ) -> PrefillAnswer:
        req.stage = "prefill"
        tried: list[str] = []
        attempt = 0
        while True:
            p = req.p
            assert p is not None
            span = self.tracer.start_span(
                sc.SPAN_PREFILL, context=ctx, kind=SpanKind.CLIENT,  # type: ignore[arg-type]
                attributes={sc.ATTEMPT: attempt, sc.INSTANCE: p.name},
            )
            kind = "error"
            self.selector.acquire(p.name)
            t0 = self.clock()
            try:
                status, ctype, raw = await self._call(p, req.endpoint, p_body, self._headers(base, span, tp_in),
                                                      self.fs.prefill_s)
                span.set_attribute(sc.HTTP_STATUS, status)
                if status == 200:
                    answer = protocol.parse_prefill_answer(raw)
                    now = self.clock()
                    self.metrics.prefill_seconds.observe(now - t0)
                    self.outliers.success(p.name, p.pool, now)
                    self._sample(p.pool, now - t0, now)
                    req.prefill = answer
                    if answer.kv_blocks:
                        span.set_attribute(sc.KV_BLOCKS, answer.kv_blocks)
                    span.end()
                    return answer
                if 400 <= status < 500:
                    raise ClientError(status, raw, CLIENT_ERROR, content_type=ctype)  # the span ends below
                kind = f"status_{status}"
            except (UpstreamTimeout, TimeoutError):
                kind = "timeout"
                self._sample(p.pool, self.clock() - t0, self.clock())
            except ConnectFailed:
                kind = "connect"
            except UpstreamError:
                kind = "closed"
            except ProtocolError:
                kind = "bad_answer"
            except BaseException:
                span.end()
                raise
            finally:
                self.selector.release(p.name)
            span.set_attribute(sc.ERROR_TYPE, kind)
            span.end()
            self.metrics.upstream_failures.labels(p.name, "prefill", kind).inc()
            now = self.clock()
            self.outliers.failure(p.name, p.pool, now)
            tried.append(p.name)
            attempt += 1
            nxt = None
            if attempt < self.fs.max_prefill_attempts:
                nxt = self.selector.pick("prefill", self.routing.view.prefill, now, exclude=tried)
            if nxt is None or not self._spend("prefill"):
                raise self._upstream_error("prefill", kind)
            req.retries += 1
            req.p = nxt
            req.p_slot = self._move_slot(req.p_slot, nxt.pool)

    async def _call(
        self, target: Target, path: str, body: bytes, headers: list[tuple[str, str]], within_s: float
    ) -> tuple[int, bytes, bytes]:
        """A whole non-streamed call: (status, content type, body), bounded by ``within_s``."""
        async with asyncio.timeout(within_s):
            resp = await self.upstream.post(target.url, path, body, headers, within_s=within_s)
            async with resp:
                raw = await resp.read()
        return resp.status, resp.header(b"content-type") or JSON, raw

    # -- handoff and decode ---------------------------------------------------------------

    async def _decode(
        self, req: RequestState, body: dict[str, object], answer: PrefillAnswer, ctx: object,
        base: list[tuple[str, str]], tp_in: str | None, reply: Reply, tried: list[str],
    ) -> None:
        assert req.p is not None and req.d is not None
        d_body = json.dumps(protocol.decode_body(body, answer.kv_transfer_params)).encode()
        kv = answer.prompt_tokens * self.fs.kv_bytes_per_token
        self._drop_kv(req)
        self.admission.add_bytes(req.p.pool, kv)
        self.admission.add_bytes(req.d.pool, kv)
        req.kv_held = (req.p.pool, req.d.pool, kv)
        if req.p_slot is not None:  # prefill is done: the P pool slot is free again
            self.admission.leave(req.p_slot)
            req.p_slot = None
        req.stage = "handoff"
        handoff = self.tracer.start_span(
            sc.SPAN_HANDOFF, context=ctx,  # type: ignore[arg-type]
            attributes={sc.P_INSTANCE: req.p.name, sc.KV_BLOCKS: answer.kv_blocks, sc.KV_BYTES: kv},
        )
        attempt = 0
        try:
            while True:
                d = req.d
                assert d is not None
                span = self.tracer.start_span(
                    sc.SPAN_DECODE, context=ctx, kind=SpanKind.CLIENT,  # type: ignore[arg-type]
                    attributes={sc.ATTEMPT: attempt, sc.INSTANCE: d.name},
                )
                try:
                    await self._decode_once(req, d, d_body, self._headers(base, span, tp_in), span, handoff, reply)
                    return
                except (ConnectFailed, DecodeRefused) as exc:
                    # D never saw the request, or refused it up front (vLLM's 503 comes before
                    # scheduling): P's blocks are unread, another D may pull them.
                    kind = exc.kind if isinstance(exc, DecodeRefused) else "connect"
                    self._decode_failed(d, span, kind)
                    tried.append(d.name)
                    attempt += 1
                    nxt = None
                    if attempt < self.fs.max_decode_attempts:
                        nxt = self.selector.pick("decode", self.routing.view.decode, self.clock(), exclude=tried)
                    if nxt is None or not self._spend("decode"):
                        raise self._upstream_error("decode", kind) from exc
                    req.retries += 1
                    req.d = nxt
                    req.d_slot = self._move_slot(req.d_slot, nxt.pool)
                    handoff.set_attribute(sc.D_INSTANCE, nxt.name)
                except NeedsPrefill as exc:
                    self._decode_failed(d, span, exc.kind)
                    raise
                finally:
                    span.end()
        finally:
            if handoff.is_recording():  # not ended yet: no first token
                handoff.end()

    async def _first_event(self, resp: UpstreamResponse, watch: SseWatch) -> bytes:
        """Read D's stream up to its first complete event: what the client gets first.

        D's own error event first, or an end before any event, is a failure before the
        first token (:class:`NeedsPrefill`); the caller bounds the wait."""
        parts: list[bytes] = []
        size = 0
        while True:
            chunk = await resp.next_chunk()
            if chunk is None:
                if watch.done:
                    return b"".join(parts)
                raise NeedsPrefill("no_done")
            parts.append(chunk)
            size += len(chunk)
            watch.feed(chunk)
            if watch.error is not None and watch.events == 0:
                raise NeedsPrefill("stream_error")
            if watch.events or watch.done or size > _FIRST_EVENT_MAX:
                return parts[0] if len(parts) == 1 else b"".join(parts)

    def _decode_failed(self, d: Target, span: trace.Span, kind: str) -> None:
        span.set_attribute(sc.ERROR_TYPE, kind)
        self.metrics.upstream_failures.labels(d.name, "decode", kind).inc()
        self.outliers.failure(d.name, d.pool, self.clock())

    async def _decode_once(
        self, req: RequestState, d: Target, d_body: bytes, headers: list[tuple[str, str]], span: trace.Span,
        handoff: trace.Span, reply: Reply,
    ) -> None:
        fs = self.fs
        loop = asyncio.get_running_loop()
        total_deadline = loop.time() + fs.decode_total_s
        # A non-streamed answer arrives whole, so only the total bound applies to it.
        first_timeout = fs.decode_first_token_s if req.stream else fs.decode_total_s
        first_deadline = min(total_deadline, loop.time() + first_timeout)
        handoff.set_attribute(sc.D_INSTANCE, d.name)
        self.selector.acquire(d.name)
        resp: UpstreamResponse | None = None
        try:
            try:
                resp = await self.upstream.post(d.url, req.endpoint, d_body, headers, within_s=first_timeout)
                span.set_attribute(sc.HTTP_STATUS, resp.status)
                async with asyncio.timeout_at(first_deadline):
                    if resp.status != 200:
                        raw = await resp.read()
                        if 400 <= resp.status < 500:  # D refused the request: not D's failure
                            raise ClientError(resp.status, raw, CLIENT_ERROR,
                                              content_type=resp.header(b"content-type") or JSON)
                        if resp.status == 503:
                            raise DecodeRefused("status_503")
                        raise NeedsPrefill(f"status_{resp.status}")
                    watch = SseWatch()
                    first = await self._first_event(resp, watch) if req.stream else await resp.read()
            except (ConnectFailed, DecodeRefused):
                raise
            except (UpstreamTimeout, TimeoutError) as exc:
                now = self.clock()
                self._sample(d.pool, now - req.admitted, now)
                raise NeedsPrefill("timeout") from exc
            except UpstreamError as exc:
                raise NeedsPrefill("closed") from exc
            # First token: the handoff is over.
            self._drop_kv(req)
            req.stage = "decode"
            t_first = time.time_ns()
            span.add_event(sc.EVENT_FIRST_TOKEN, timestamp=t_first)
            handoff.end(end_time=t_first)
            now = self.clock()
            self.metrics.ttft_seconds.observe(now - req.started)
            self._sample(d.pool, now - req.admitted, now)
            ctype = resp.header(b"content-type") or (b"text/event-stream" if req.stream else JSON)
            out_headers = [(b"content-type", ctype), (b"x-request-id", req.rid.encode())]
            if not req.stream:
                req.completion_tokens = protocol.completion_tokens(first or b"")
                if req.completion_tokens is not None:
                    span.set_attribute(sc.COMPLETION_TOKENS, req.completion_tokens)
                out_headers.append((b"content-length", str(len(first or b"")).encode()))
                await reply.start(200, out_headers)
                await reply.body(first or b"", False)
                req.outcome = "ok"
                self.outliers.success(d.name, d.pool, self.clock())
                return
            await reply.start(200, out_headers)
            if first:
                await reply.body(first, True)
            kind: str | None = None
            try:
                async with asyncio.timeout_at(total_deadline):
                    while watch.error is None and (chunk := await resp.next_chunk()) is not None:
                        watch.feed(chunk)
                        await reply.body(chunk, True)
            except (UpstreamError, TimeoutError) as exc:
                kind = "timeout" if isinstance(exc, TimeoutError) else "closed"
            if kind is None and watch.error is not None:
                kind = "stream_error"  # D's own error event, already forwarded
            elif kind is None and not watch.done:
                kind = "no_done"  # D ended the stream without [DONE]: the answer may be cut
            if kind is None:
                await reply.body(b"", False)
                req.outcome = "ok"
                self.outliers.success(d.name, d.pool, self.clock())
                return
            self._decode_failed(d, span, kind)
            req.outcome = "timeout" if kind == "timeout" else "error"
            if kind == "stream_error":
                await reply.body(b"", False)
                return
            err = protocol.error_body(f"decode {kind} after the first token", "upstream_error",
                                      "upstream_" + kind)
            await reply.body(b"data: " + err + b"\n\n", False)
        finally:
            self.selector.release(d.name)
            if resp is not None:
                resp.close()
