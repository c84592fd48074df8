"""A minimal two-step P/D client for tests against real vLLM (NixlConnector, pull mode).

The protocol, as vLLM's toy proxy speaks it:

1. POST the client's body to P with ``max_tokens=1`` (and ``max_completion_tokens=1`` if set),
   ``stream=false``, no ``stream_options``, and ``kv_transfer_params`` asking for a remote decode
   (:data:`PREFILL_KV_PARAMS`). P answers an ordinary response plus ``kv_transfer_params``
   (``remote_engine_id``, ``remote_block_ids``, ``remote_request_id``, ``remote_host/port``, ...).
2. POST the original body to D with P's ``kv_transfer_params`` verbatim; D pulls the KV blocks
   over NIXL and generates (streaming or not, as the client asked).

Both steps carry the same ``X-Request-Id`` and, when given, the same ``traceparent``.

Also here: :func:`scrape` (a ``/metrics`` page as :class:`Metrics`) and :func:`make_traceparent`;
to poll, use ``tests.support.waiting.wait_until``. Reused by every real-vLLM test; keep it dependency-light
(httpx and prometheus_client only) and free of assertions about vLLM's behaviour.
"""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

Kind = Literal["completions", "chat"]
PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}

PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

T = TypeVar("T")


# -- requests ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillResult:
    status: int
    body: dict[str, Any]
    kv_transfer_params: dict[str, Any] | None
    request_id: str


@dataclass(frozen=True)
class DecodeResult:
    """D's answer: the generated text, and for a stream every ``data:`` payload."""

    status: int
    text: str
    body: dict[str, Any] | None = None
    chunks: list[dict[str, Any]] = field(default_factory=list)
    raw: str = ""


def _headers(request_id: str, traceparent: str | None) -> dict[str, str]:
    h = {"X-Request-Id": request_id}
    if traceparent:
        h["traceparent"] = traceparent
    return h


def request_body(kind: Kind, prompt: str, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    """A greedy client body for the pair's model ("tiny"): ``prompt`` or one user message."""
    body: dict[str, Any] = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def response_text(kind: Kind, body: Mapping[str, Any]) -> str:
    choice = body["choices"][0]
    if kind == "chat":
        return str(choice["message"].get("content") or "")
    return str(choice["text"])


def stream_text(kind: Kind, raw: str) -> str:
    """The generated text of a streamed answer (its ``data:`` events, in order)."""
    parts = []
    for line in raw.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:]).get("choices") or []:
                piece = choice.get("delta", {}).get("content") if kind == "chat" else choice.get("text")
                parts.append(piece or "")
    return "".join(parts)


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body P gets in step 1."""
    p = dict(body)
    p["stream"] = False
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        p.pop(key, None)
    p["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return p


def prefill(
    client: httpx.Client,
    prefill_url: str,
    kind: Kind,
    body: Mapping[str, Any],
    request_id: str | None = None,
    traceparent: str | None = None,
) -> PrefillResult:
    """Step 1. Never raises on an HTTP error status; the caller checks ``status``."""
    rid = request_id or str(uuid.uuid4())
    r = client.post(prefill_url + PATHS[kind], json=prefill_body(body), headers=_headers(rid, traceparent))
    is_json = r.headers.get("content-type", "").startswith("application/json")
    data: dict[str, Any] = r.json() if is_json else {"raw": r.text}
    ktp = data.get("kv_transfer_params")
    return PrefillResult(r.status_code, data, ktp if isinstance(ktp, dict) else None, rid)


def decode(
    client: httpx.Client,
    decode_url: str,
    kind: Kind,
    body: Mapping[str, Any],
    kv_transfer_params: Mapping[str, Any] | None,
    request_id: str,
    traceparent: str | None = None,
) -> DecodeResult:
    """Step 2: the original body plus P's ``kv_transfer_params``; follows a stream to its end."""
    d = dict(body)
    if kv_transfer_params is not None:
        d["kv_transfer_params"] = dict(kv_transfer_params)
    headers = _headers(request_id, traceparent)
    url = decode_url + PATHS[kind]
    if not body.get("stream"):
        r = client.post(url, json=d, headers=headers)
        try:
            data = r.json()
        except json.JSONDecodeError:
            return DecodeResult(r.status_code, "", None, [], r.text)
        text = response_text(kind, data) if r.status_code == 200 and data.get("choices") else ""
        return DecodeResult(r.status_code, text, data, [], r.text)
    chunks: list[dict[str, Any]] = []
    lines: list[str] = []
    with client.stream("POST", url, json=d, headers=headers) as r:
        for line in r.iter_lines():
            lines.append(line)
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
        status = r.status_code
    parts: list[str] = []
    for c in chunks:
        for choice in c.get("choices") or []:
            piece = choice.get("delta", {}).get("content") if kind == "chat" else choice.get("text")
            parts.append(piece or "")
    return DecodeResult(status, "".join(parts), None, chunks, "\n".join(lines))


def two_step(
    client: httpx.Client,
    prefill_url: str,
    decode_url: str,
    kind: Kind,
    body: Mapping[str, Any],
    traceparent: str | None = None,
    request_id: str | None = None,
) -> tuple[PrefillResult, DecodeResult]:
    """Both steps. Raises ``RuntimeError`` if P does not answer 200 with kv_transfer_params."""
    p = prefill(client, prefill_url, kind, body, request_id, traceparent)
    if p.status != 200 or not p.kv_transfer_params:
        raise RuntimeError(f"prefill failed: HTTP {p.status}: {json.dumps(p.body)[:500]}")
    d = decode(client, decode_url, kind, body, p.kv_transfer_params, p.request_id, traceparent)
    return p, d


def direct(client: httpx.Client, url: str, kind: Kind, body: Mapping[str, Any]) -> str:
    """An ordinary, non-disaggregated request; returns the generated text. Raises on non-200."""
    r = client.post(url + PATHS[kind], json=dict(body, stream=False))
    r.raise_for_status()
    return response_text(kind, r.json())


# -- tracing ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceParent:
    trace_id: str
    span_id: str

    @property
    def header(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-01"


def make_traceparent() -> TraceParent:
    """A fresh sampled W3C trace context (random ids)."""
    return TraceParent(secrets.token_hex(16), secrets.token_hex(8))


# -- metrics ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Metrics:
    """One ``/metrics`` page: sample name -> list of (labels, value)."""

    text: str
    samples: dict[str, list[tuple[dict[str, str], float]]]

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples named ``name`` whose labels include ``labels`` (0.0 if none)."""
        return sum(
            v for lab, v in self.samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())
        )

    def has(self, name: str) -> bool:
        return name in self.samples

    def families(self) -> set[str]:
        return set(self.samples)


def parse_metrics(text: str) -> Metrics:
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return Metrics(text, samples)


def scrape(client: httpx.Client, base_url: str) -> Metrics:
    r = client.get(base_url + "/metrics")
    r.raise_for_status()
    return parse_metrics(r.text)
