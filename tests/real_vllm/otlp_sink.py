"""An OTLP/HTTP trace sink that tests control: it receives what real vLLM exports.

A small threaded HTTP server on 127.0.0.1 (free port) that accepts ``POST /v1/traces`` with a
protobuf ``ExportTraceServiceRequest`` (what vLLM sends with
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``), keeps every raw body and the decoded spans
(with their resource's ``service.name``), and answers 200 with an empty
``ExportTraceServiceResponse``.

``forward_to`` (settable at any time, ``None`` by default) makes it also POST each raw body,
unchanged, to another OTLP/HTTP receiver, e.g. pdscope's collector; the forwarding results are
kept in ``forward_results`` so a test can see a refused body. It never raises into the server
thread. JSON bodies (``application/json``) are kept raw but not decoded.

This is test support: it must not import pdscope's services.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

log = logging.getLogger(__name__)


def _any_value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind)


@dataclass(frozen=True)
class SinkSpan:
    """One received span, ids as lowercase hex ('' for no parent)."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    service_name: str
    scope: str
    attributes: dict[str, Any] = field(hash=False)
    resource: dict[str, Any] = field(hash=False)


@dataclass(frozen=True)
class RawBody:
    received_at: float
    content_type: str
    body: bytes


def decode_spans(body: bytes) -> list[SinkSpan]:
    """Decode one protobuf ExportTraceServiceRequest into spans. Raises on a malformed body."""
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    spans: list[SinkSpan] = []
    for rs in req.resource_spans:
        resource = {kv.key: _any_value(kv.value) for kv in rs.resource.attributes}
        service = str(resource.get("service.name", ""))
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(
                    SinkSpan(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        name=s.name,
                        kind=s.kind,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        service_name=service,
                        scope=ss.scope.name,
                        attributes={kv.key: _any_value(kv.value) for kv in s.attributes},
                        resource=resource,
                    )
                )
    return spans


def body_to_json(body: bytes) -> dict[str, Any]:
    """The OTLP/JSON rendering of a protobuf body (ids as hex, as OTLP/JSON requires)."""
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    data: dict[str, Any] = MessageToDict(req, preserving_proto_field_name=False)
    for rs in data.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for s in ss.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in s:
                        s[key] = _b64_to_hex(s[key])
    return data


def _b64_to_hex(value: str) -> str:
    import base64

    return base64.b64decode(value).hex()


class OtlpSink:
    """Start with :meth:`start`, stop with :meth:`stop`; thread-safe accessors."""

    def __init__(self) -> None:
        self.forward_to: str | None = None
        self.forward_results: list[tuple[str, int | str]] = []
        self._bodies: list[RawBody] = []
        self._spans: list[SinkSpan] = []
        self._errors: list[str] = []
        self._cond = threading.Condition()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> OtlpSink:
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                ctype = self.headers.get("Content-Type", "")
                if self.path.rstrip("/") != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                sink._receive(ctype, body)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-sink", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def port(self) -> int:
        assert self._server is not None, "sink not started"
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """The traces endpoint to give vLLM's ``--otlp-traces-endpoint``."""
        return f"http://127.0.0.1:{self.port}/v1/traces"

    # -- receiving ------------------------------------------------------------------------

    def _receive(self, ctype: str, body: bytes) -> None:
        spans: list[SinkSpan] = []
        if "json" not in ctype:
            try:
                spans = decode_spans(body)
            except Exception as exc:  # a malformed body is recorded, never raised
                with self._cond:
                    self._errors.append(f"undecodable body ({len(body)} bytes): {exc}")
        with self._cond:
            self._bodies.append(RawBody(time.time(), ctype, body))
            self._spans.extend(spans)
            self._cond.notify_all()
        target = self.forward_to
        if target:
            try:
                r = httpx.post(target, content=body, headers={"Content-Type": ctype}, timeout=5.0)
                result: int | str = r.status_code
            except httpx.HTTPError as exc:
                result = f"{type(exc).__name__}: {exc}"
            with self._cond:
                self.forward_results.append((target, result))

    # -- reading --------------------------------------------------------------------------

    def spans(self) -> list[SinkSpan]:
        with self._cond:
            return list(self._spans)

    def bodies(self) -> list[RawBody]:
        with self._cond:
            return list(self._bodies)

    def errors(self) -> list[str]:
        with self._cond:
            return list(self._errors)

    def wait_for_spans(
        self, predicate: Callable[[SinkSpan], bool], count: int = 1, timeout_s: float = 20.0
    ) -> list[SinkSpan]:
        """Block until ``count`` received spans match ``predicate``; return them.

        Raises ``TimeoutError`` naming what did arrive when the bounded wait ends.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                found = [s for s in self._spans if predicate(s)]
                if len(found) >= count:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    seen = sorted({(s.service_name, s.name) for s in self._spans})
                    raise TimeoutError(
                        f"{len(found)}/{count} matching spans after {timeout_s}s; "
                        f"received {len(self._spans)} spans in all: {seen}"
                    )
                self._cond.wait(left)
