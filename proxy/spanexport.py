"""The proxy's OTLP/HTTP span exporter: one POST per batch, and a verdict the queue can act on.

OpenTelemetry's own exporter answers only success or failure; the proxy's span queue
(``proxy.tracing``) needs to know whether a batch is worth trying again and when: a
network error, a 408/429 or a 5xx is (after ``Retry-After`` when the collector sends one);
any other 4xx is not (the collector refused the batch itself: retrying would block the
queue behind it). Sends ``Authorization: Bearer <token>`` when a token is given.

Runs on the span-export thread only (a blocking ``httpx.Client``); never logs per batch.
"""

from __future__ import annotations

import email.utils
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger(__name__)

MAX_RETRY_AFTER_S = 60.0  # a collector's Retry-After is honoured up to this


@dataclass(frozen=True, slots=True)
class Sent:
    """What became of one batch: delivered, or worth another try (after ``retry_after_s``)."""

    ok: bool
    retry: bool = False
    retry_after_s: float | None = None
    status: int | None = None


def retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date), bounded; None if absent
    or bad."""
    if not value:
        return None
    value = value.strip()
    seconds: float | None
    if value.isdigit():
        seconds = float(value)
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    return min(MAX_RETRY_AFTER_S, max(0.0, seconds))


class OtlpHttpExporter(SpanExporter):
    """POST ``ExportTraceServiceRequest`` protobuf to ``endpoint`` (…/v1/traces)."""

    def __init__(self, endpoint: str, *, timeout_s: float = 2.0, token: str | None = None) -> None:
        self.endpoint = endpoint
        headers = {"Content-Type": "application/x-protobuf"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._client = httpx.Client(timeout=timeout_s, headers=headers)

    def send(self, batch: Sequence[ReadableSpan]) -> Sent:
        try:
            payload = encode_spans(batch).SerializePartialToString()
        except Exception:  # a span the encoder cannot take: the batch can never go
            log.debug("span batch could not be encoded", exc_info=True)
            return Sent(ok=False)
        try:
            resp = self._client.post(self.endpoint, content=payload)
        except httpx.HTTPError as exc:
            log.debug("span export failed: %s", exc)
            return Sent(ok=False, retry=True)
        status = resp.status_code
        if 200 <= status < 300:
            return Sent(ok=True, status=status)
        retryable = status in (408, 429) or status >= 500
        wait = retry_after(resp.headers.get("retry-after")) if retryable else None
        return Sent(ok=False, retry=retryable, retry_after_s=wait, status=status)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS if self.send(spans).ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self._client.close()
