"""The attempts at one stage (prefill on a P, decode on a D) and their failure rules.

Why the rules are what they are: P's pinned KV blocks are meant to be read once, by one D.

- P fails or times out: counted against P (``proxy.outlier``), retried on another P while
  attempts and the retry budget allow.
- D cannot be connected to, or answers 503 (vLLM refuses before scheduling): it never
  started the NIXL read, so another D may pull P's blocks: retried on another D with the
  same ``kv_transfer_params`` (:class:`proxy.request.DecodeRefused`).
- D accepted and then failed or timed out before its first token, or its stream's first
  event is its own error, or the stream ends before any event: P's blocks may be gone, so
  only a new prefill can retry (:class:`proxy.request.NeedsPrefill`; ``proxy.flow`` decides).
- After the first byte went to the client: no retry; a stream ends with an OpenAI-style
  error event (D's own in-band error is forwarded as it is), the failure counted against D.
- A 4xx from P or D is the client's: passed through unchanged, never retried, not counted.
- Successes count too (the outlier window holds a failure *ratio*), and each success's
  latency (P: the call; D: admission to first token) and each timeout is a sample for the
  pool's adaptive limit (``proxy.concurrency``).

Every retry pick goes through admission (:meth:`proxy.gate.Gate.retry`).

The decode-only path (KV-aware routing's conditional disaggregation, :meth:`Attempts.decode_alone`):
D gets the client's body as it came, without ``kv_transfer_params``, and computes the whole
prompt itself (vLLM's own non-disaggregated path). No P holds blocks for it, so every failure
before the first token -- refused, unreachable, or failed after accepting -- is retried on
another D alone, like a refused decode (while decode attempts and the retry budget allow); it
never falls back to a prefill, which would be a second routing decision for the same request.
After the first byte: no retry, as on the P/D path.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from pdscope import semconv as sc
from proxy import protocol
from proxy.admission import Admission
from proxy.gate import Gate
from proxy.metrics import ProxyMetrics
from proxy.outlier import OutlierDetector
from proxy.priority import with_priority
from proxy.protocol import PrefillAnswer, ProtocolError, SseWatch
from proxy.push import check_mode
from proxy.request import (
    JSON,
    ClientError,
    DecodeRefused,
    FlowSettings,
    NeedsPrefill,
    Reply,
    RequestState,
    client_error,
)
from proxy.routing import RoutingState, Target
from proxy.selection import RetryBudget, Selector
from proxy.tracing import traceparent
from proxy.upstream import ConnectFailed, UpstreamClient, UpstreamError, UpstreamResponse, UpstreamTimeout

CLIENT_ERROR = sc.OUTCOME_CLIENT_ERROR
_FIRST_EVENT_MAX = 1 << 20  # bytes read while waiting for D's first complete event

Headers = list[tuple[str, str]]


def upstream_error(stage: str, kind: str) -> ClientError:
    """The client's answer when ``stage`` failed with ``kind`` and no retry is left."""
    if kind == "timeout":
        return client_error(504, f"{stage} timed out", "timeout_error", "timeout", "upstream_timeout")
    return client_error(502, f"{stage} failed ({kind})", "upstream_error", "error", "upstream_" + kind)


def with_traceparent(base: Headers, span: trace.Span, tp_in: str | None, sampled: bool) -> Headers:
    """``base`` and the ``traceparent`` naming ``span`` (its flag: the head decision ``sampled``, so
    vLLM traces what the proxy keeps); with tracing off, the caller's own ``tp_in``."""
    tp = traceparent(span, sampled) or tp_in
    return [*base, ("traceparent", tp)] if tp else base


def failure_kind(exc: Exception) -> str:
    """The failure kind of a decode attempt's exception."""
    if isinstance(exc, ConnectFailed):
        return "connect"
    return exc.kind if isinstance(exc, DecodeRefused | NeedsPrefill) else "error"


def _end(span: trace.Span) -> int:
    """End ``span`` now; the time it ended (Unix ns), which the root span carries too."""
    t = time.time_ns()
    span.end(end_time=t)
    return t


@dataclass(eq=False)
class Attempts:
    """Prefill and decode attempts for one proxy (shared by its requests)."""

    fs: FlowSettings
    upstream: UpstreamClient
    gate: Gate
    routing: RoutingState
    selector: Selector
    admission: Admission
    budget: RetryBudget
    metrics: ProxyMetrics
    tracer: trace.Tracer
    clock: Callable[[], float]
    outliers: OutlierDetector = field(init=False)

    def __post_init__(self) -> None:
        self.outliers = self.selector.outliers

    def spend(self, stage: str) -> bool:
        """One retry at ``stage`` from the budget (counted either way)."""
        if self.budget.try_spend():
            self.metrics.retries.labels(stage).inc()
            return True
        self.metrics.retries_refused.labels(stage).inc()
        return False

    def _sample(self, pool: str, seconds: float, now: float) -> None:
        """A latency sample for ``pool``'s adaptive limit (when it is on)."""
        adaptive = self.admission.adaptive
        if adaptive is not None:
            ceiling = self.routing.view.limits_for(pool, self.fs.default_limits).max_inflight_requests
            adaptive.observe(pool, seconds, self.admission.requests[pool], ceiling, now)

    # -- prefill ----------------------------------------------------------------------

    async def prefill(
        self, req: RequestState, p_body: bytes, ctx: Context, base: Headers, tp_in: str | None
    ) -> PrefillAnswer:
        """P's answer, from ``req.p`` or the P a retry moved it to."""
        req.stage = "prefill"
        tried: list[str] = []
        attempt = 0
        while True:
            p = req.p
            assert p is not None
            req.p_sent_ns, req.p_done_ns = time.time_ns(), None
            span = self.tracer.start_span(
                sc.SPAN_PREFILL,
                context=ctx,
                kind=SpanKind.CLIENT,
                attributes={sc.ATTEMPT: attempt, sc.INSTANCE: p.name},
                start_time=req.p_sent_ns,
            )
            headers = with_traceparent(base, span, tp_in, req.sampled)
            answer, kind = await self._prefill_once(req, p, p_body, headers, span)
            if answer is not None:
                return answer
            self.metrics.upstream_failures.labels(p.name, "prefill", kind).inc()
            self.outliers.failure(p.name, p.pool, self.clock())
            tried.append(p.name)
            attempt += 1
            nxt = None
            if attempt < self.fs.max_prefill_attempts:
                nxt = self.gate.retry(req, "prefill", tried, spend=lambda: self.spend("prefill"))
            if nxt is None:
                raise upstream_error("prefill", kind)
            req.retries += 1

    async def _prefill_once(
        self, req: RequestState, p: Target, p_body: bytes, headers: Headers, span: trace.Span
    ) -> tuple[PrefillAnswer | None, str]:
        """One call to P: its answer, or (None, the failure's kind). Ends ``span``."""
        kind = "error"
        self.selector.acquire(p.name)
        t0 = self.clock()
        try:
            body = self._leg_body(req, p, p_body)
            status, ctype, raw = await self._call(p, req.endpoint, body, headers, self.fs.prefill_s)
            span.set_attribute(sc.HTTP_STATUS, status)
            if status == 200:
                answer = protocol.parse_prefill_answer(raw)
                check_mode(answer.kv_transfer_params, self.fs.handoff)
                now = self.clock()
                self.metrics.prefill_seconds.observe(now - t0)
                self.outliers.success(p.name, p.pool, now)
                self._sample(p.pool, now - t0, now)
                req.prefill = answer
                if answer.kv_blocks:
                    span.set_attribute(sc.KV_BLOCKS, answer.kv_blocks)
                req.p_done_ns = _end(span)
                return answer, ""
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
            req.p_done_ns = _end(span)
            raise
        finally:
            self.selector.release(p.name)
        span.set_attribute(sc.ERROR_TYPE, kind)
        req.p_done_ns = _end(span)
        return None, kind

    def _leg_body(self, req: RequestState, target: Target, body: bytes) -> bytes:
        """The leg's body for ``target``: with the request's priority when vLLM schedules ``target`` by
        priority (``proxy.priority``), else as it is."""
        if req.priority is None or target.name not in self.fs.priority_ps:
            return body
        return with_priority(body, req.priority)

    async def _call(
        self, target: Target, path: str, body: bytes, headers: Headers, within_s: float
    ) -> tuple[int, bytes, bytes]:
        """A whole non-streamed call: (status, content type, body), bounded by ``within_s``."""
        async with asyncio.timeout(within_s):
            resp = await self.upstream.post(target.url, path, body, headers, within_s=within_s)
            async with resp:
                raw = await resp.read()
        return resp.status, resp.header(b"content-type") or JSON, raw

    # -- handoff and decode -----------------------------------------------------------

    async def decode(
        self,
        req: RequestState,
        raw: bytes,
        body: dict[str, object],
        answer: PrefillAnswer,
        ctx: Context,
        base: Headers,
        tp_in: str | None,
        reply: Reply,
        tried: list[str],
    ) -> None:
        """Hand P's KV to ``req.d`` (or the D a retry moved it to) and stream its answer to the client.
        ``raw`` is the client's body as it came (``body`` parsed): D gets it with P's KV params."""
        assert req.p is not None and req.d is not None
        d_body = protocol.decode_bytes(raw, body, answer.kv_transfer_params)
        kv = answer.prompt_tokens * self.fs.kv_bytes_per_token
        self.gate.hold_kv(req, kv)
        req.stage = "handoff"
        handoff = self.tracer.start_span(
            sc.SPAN_HANDOFF,
            context=ctx,
            attributes={sc.P_INSTANCE: req.p.name, sc.KV_BLOCKS: answer.kv_blocks, sc.KV_BYTES: kv},
        )
        attempt = 0
        try:
            while True:
                with self._decode_attempt(req, attempt, ctx, base, tp_in) as (d, span, headers):
                    try:
                        await self._decode_once(req, d, d_body, headers, span, handoff, reply)
                        return
                    except (ConnectFailed, DecodeRefused) as exc:
                        # D never saw the request, or refused it up front (vLLM's 503 comes before
                        # scheduling): P's blocks are unread, another D may pull them.
                        kind = exc.kind if isinstance(exc, DecodeRefused) else "connect"
                        attempt += 1
                        nxt = self._next_decode(req, d, span, kind, tried, attempt, exc)
                        handoff.set_attribute(sc.D_INSTANCE, nxt.name)
                    except NeedsPrefill as exc:
                        self._decode_failed(d, span, exc.kind)
                        raise
        finally:
            if handoff.is_recording():  # not ended yet: no first token
                handoff.end()

    async def decode_alone(
        self, req: RequestState, raw: bytes, ctx: Context, base: Headers, tp_in: str | None, reply: Reply
    ) -> None:
        """The decode-only path: ``req.d`` (or the D a retry moved it to) computes the prompt and
        answers; the client's ``raw`` body goes as it came."""
        req.stage = "decode"
        tried: list[str] = []
        attempt = 0
        while True:
            with self._decode_attempt(req, attempt, ctx, base, tp_in) as (d, span, headers):
                try:
                    await self._decode_once(req, d, raw, headers, span, None, reply)
                    return
                except (ConnectFailed, DecodeRefused, NeedsPrefill) as exc:
                    kind = "connect" if isinstance(exc, ConnectFailed) else exc.kind
                    attempt += 1
                    self._next_decode(req, d, span, kind, tried, attempt, exc)

    async def decode_early(
        self, req: RequestState, d_body: bytes, ctx: Context, base: Headers, tp_in: str | None, reply: Reply
    ) -> None:
        """Push mode: D's leg sent with P's (``proxy.push``), one attempt on ``req.d``, its first token
        awaited past P's prefill too. A failure before the first token raises (``ConnectFailed``,
        ``DecodeRefused``, ``NeedsPrefill``) with its kind on the span but not counted: whose it is
        depends on P's answer (:meth:`early_failed`)."""
        assert req.p is not None
        handoff = self.tracer.start_span(sc.SPAN_HANDOFF, context=ctx, attributes={sc.P_INSTANCE: req.p.name})
        try:
            with self._decode_attempt(req, 0, ctx, base, tp_in) as (d, span, headers):
                try:
                    await self._decode_once(req, d, d_body, headers, span, handoff, reply, self.fs.prefill_s)
                except (ConnectFailed, DecodeRefused, NeedsPrefill) as exc:
                    span.set_attribute(sc.ERROR_TYPE, failure_kind(exc))
                    raise
        finally:
            if handoff.is_recording():
                handoff.end()

    def early_failed(self, req: RequestState, d: Target, exc: Exception, tried: list[str]) -> None:
        """The early leg on ``d`` failed and P's answer named the engine it registered with: D's failure.
        D never saw it (connect, 503): ``req`` moves to another D for the same KV; else ``exc`` again."""
        kind = failure_kind(exc)
        if isinstance(exc, ConnectFailed | DecodeRefused):
            self._next_decode(req, d, None, kind, tried, 1, exc)
            return
        self._decode_failed(d, None, kind)
        raise exc

    def _next_decode(
        self,
        req: RequestState,
        d: Target,
        span: trace.Span | None,
        kind: str,
        tried: list[str],
        attempt: int,
        exc: Exception,
    ) -> Target:
        """Decode attempt ``attempt`` failed on ``d`` (``kind``): the D the request moves to, within
        ``max_decode_attempts`` and the retry budget; else the failure as the client's 502/504."""
        self._decode_failed(d, span, kind)
        tried.append(d.name)
        nxt = None
        if attempt < self.fs.max_decode_attempts:
            nxt = self.gate.retry(req, "decode", tried, spend=lambda: self.spend("decode"))
        if nxt is None:
            raise upstream_error("decode", kind) from exc
        req.retries += 1
        return nxt

    @contextlib.contextmanager
    def _decode_attempt(
        self, req: RequestState, attempt: int, ctx: Context, base: Headers, tp_in: str | None
    ) -> Iterator[tuple[Target, trace.Span, Headers]]:
        """Decode attempt ``attempt`` on ``req.d``: D, the attempt's span and the headers naming it.
        The span ends on leaving the block, after the block's own ``except`` clauses have run."""
        d = req.d
        assert d is not None
        span = self._decode_span(req, d, attempt, ctx)
        try:
            yield d, span, with_traceparent(base, span, tp_in, req.sampled)
        finally:
            span.end()

    def _decode_span(self, req: RequestState, d: Target, attempt: int, ctx: Context) -> trace.Span:
        """The span of one decode attempt on ``d``, started now (also D's sent time on the request)."""
        req.d_sent_ns = time.time_ns()
        return self.tracer.start_span(
            sc.SPAN_DECODE,
            context=ctx,
            kind=SpanKind.CLIENT,
            attributes={sc.ATTEMPT: attempt, sc.INSTANCE: d.name},
            start_time=req.d_sent_ns,
        )

    def _decode_failed(self, d: Target, span: trace.Span | None, kind: str) -> None:
        if span is not None:
            span.set_attribute(sc.ERROR_TYPE, kind)
        self.metrics.upstream_failures.labels(d.name, "decode", kind).inc()
        self.outliers.failure(d.name, d.pool, self.clock())

    async def _decode_once(
        self,
        req: RequestState,
        d: Target,
        d_body: bytes,
        headers: Headers,
        span: trace.Span,
        handoff: trace.Span | None,
        reply: Reply,
        wait_s: float = 0.0,
    ) -> None:
        """One call to D up to the end of its answer; ``handoff`` None on the decode-only path; ``wait_s``
        more for its first token (push mode's early leg: P's prefill)."""
        total_deadline = asyncio.get_running_loop().time() + self.fs.decode_total_s + wait_s
        if handoff is not None:
            handoff.set_attribute(sc.D_INSTANCE, d.name)
        self.selector.acquire(d.name)
        resp: UpstreamResponse | None = None
        try:
            resp, first, watch = await self._until_first_token(
                req, d, d_body, headers, span, total_deadline, wait_s
            )
            self._first_token(req, d, span, handoff)
            ctype = resp.header(b"content-type") or (b"text/event-stream" if req.stream else JSON)
            out_headers = [(b"content-type", ctype), (b"x-request-id", req.rid.encode())]
            if req.stream:
                await self._stream(req, d, resp, first, watch, out_headers, span, reply, total_deadline)
                return
            usage = protocol.usage_of(first)
            req.completion_tokens = usage.completion_tokens
            req.d_prompt_tokens, req.d_cached_tokens = usage.prompt_tokens, usage.cached_tokens
            if req.completion_tokens is not None:
                span.set_attribute(sc.COMPLETION_TOKENS, req.completion_tokens)
            out_headers.append((b"content-length", str(len(first)).encode()))
            await reply.start(200, out_headers)
            await reply.body(first, False)
            req.outcome = "ok"
            self.outliers.success(d.name, d.pool, self.clock())
        finally:
            self.selector.release(d.name)
            if resp is not None:
                resp.close()

    def _first_token(
        self, req: RequestState, d: Target, span: trace.Span, handoff: trace.Span | None
    ) -> None:
        """D's first token: the handoff is over."""
        self.gate.drop_kv(req)
        req.stage = "decode"
        t_first = req.first_token_ns = time.time_ns()
        span.add_event(sc.EVENT_FIRST_TOKEN, timestamp=t_first)
        if handoff is not None:
            handoff.end(end_time=t_first)
        now = self.clock()
        self.metrics.ttft_seconds.observe(now - req.started)
        self.gate.first_token(req, now)
        self._sample(d.pool, now - req.admitted, now)

    async def _until_first_token(
        self,
        req: RequestState,
        d: Target,
        d_body: bytes,
        headers: Headers,
        span: trace.Span,
        total_deadline: float,
        wait_s: float = 0.0,
    ) -> tuple[UpstreamResponse, bytes, SseWatch]:
        """D's answer up to what the client gets first (its first event; the whole body when not
        streamed), or the failure that decides the retry: ``ConnectFailed``/``DecodeRefused`` (same
        KV) or ``NeedsPrefill``. A 4xx is the client's ``ClientError``."""
        # A non-streamed answer arrives whole, so only the total bound applies to it.
        first_timeout = (self.fs.decode_first_token_s if req.stream else self.fs.decode_total_s) + wait_s
        first_deadline = min(total_deadline, asyncio.get_running_loop().time() + first_timeout)
        resp: UpstreamResponse | None = None
        try:
            try:
                body = self._leg_body(req, d, d_body)
                resp = await self.upstream.post(d.url, req.endpoint, body, headers, within_s=first_timeout)
                span.set_attribute(sc.HTTP_STATUS, resp.status)
                async with asyncio.timeout_at(first_deadline):
                    if resp.status != 200:
                        raw = await resp.read()
                        if 400 <= resp.status < 500:  # D refused the request: not D's failure
                            raise ClientError(
                                resp.status,
                                raw,
                                CLIENT_ERROR,
                                content_type=resp.header(b"content-type") or JSON,
                            )
                        if resp.status == 503:
                            raise DecodeRefused("status_503")
                        raise NeedsPrefill(f"status_{resp.status}")
                    watch = SseWatch()
                    first = await self._first_event(resp, watch) if req.stream else await resp.read()
                return resp, first, watch
            except (ConnectFailed, DecodeRefused):
                raise
            except (UpstreamTimeout, TimeoutError) as exc:
                now = self.clock()
                self._sample(d.pool, now - req.admitted, now)
                raise NeedsPrefill("timeout") from exc
            except UpstreamError as exc:
                raise NeedsPrefill("closed") from exc
        except BaseException:
            if resp is not None:  # the caller only closes what it got
                resp.close()
            raise

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

    async def _stream(
        self,
        req: RequestState,
        d: Target,
        resp: UpstreamResponse,
        first: bytes,
        watch: SseWatch,
        out_headers: list[tuple[bytes, bytes]],
        span: trace.Span,
        reply: Reply,
        total_deadline: float,
    ) -> None:
        """The rest of D's stream after the first event: no retry from here; a failure ends the
        stream with an error event and counts against D."""
        await reply.start(200, out_headers)
        if first:
            await reply.body(first, True)
        kind: str | None = None
        last = b""  # D's last bytes when they came with the end of its answer: sent with the client's end
        try:
            async with asyncio.timeout_at(total_deadline):
                while watch.error is None and (chunk := await resp.next_chunk()) is not None:
                    watch.feed(chunk)
                    if watch.done and watch.error is None and getattr(resp, "complete", False):
                        last = chunk  # one write for the last event and the end of the stream
                        break
                    await reply.body(chunk, True)
        except (UpstreamError, TimeoutError) as exc:
            kind = "timeout" if isinstance(exc, TimeoutError) else "closed"
        if watch.completion_tokens is not None:  # D's usage event: the root carries it
            req.completion_tokens = watch.completion_tokens
            req.d_prompt_tokens, req.d_cached_tokens = watch.prompt_tokens, watch.cached_tokens
            span.set_attribute(sc.COMPLETION_TOKENS, watch.completion_tokens)
        if kind is None and watch.error is not None:
            kind = "stream_error"  # D's own error event, already forwarded
        elif kind is None and not watch.done:
            kind = "no_done"  # D ended the stream without [DONE]: the answer may be cut
        if kind is None:
            await reply.body(last, False)
            req.outcome = "ok"
            self.outliers.success(d.name, d.pool, self.clock())
            return
        self._decode_failed(d, span, kind)
        req.outcome = "timeout" if kind == "timeout" else "error"
        if kind == "stream_error":
            await reply.body(b"", False)
            return
        err = protocol.error_body(
            f"decode {kind} after the first token", "upstream_error", "upstream_" + kind
        )
        await reply.body(b"data: " + err + b"\n\n", False)
