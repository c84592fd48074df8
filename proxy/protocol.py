"""vLLM's NIXL pull protocol, as pure functions on request and answer bodies.

1. Prefill: the client body with ``max_tokens=1`` (and ``max_completion_tokens=1`` when
   the client sent it), ``stream=false``, ``stream_options`` removed, ``min_tokens`` /
   ``min_completion_tokens`` removed (P must stop after one token), and
   ``kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false, remote_*: null}``.
2. P answers with ``kv_transfer_params`` (engine id, block ids, host, port, ...).
3. Decode: the client body unchanged except ``kv_transfer_params``, replaced by P's dict
   verbatim. The same ``X-Request-Id`` goes to P and D.

No I/O here; :class:`ProtocolError` when P's answer is not what the protocol needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdscope.vllmapi import PREFILL_KV_PARAMS as PREFILL_KV_PARAMS

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


class ProtocolError(Exception):
    """A body that the P/D protocol cannot use (the client's or an upstream's)."""


@dataclass(frozen=True, slots=True)
class PrefillAnswer:
    kv_transfer_params: dict[str, Any] | None
    prompt_tokens: int
    kv_blocks: int
    remote_engine_id: str | None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when P reported it


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_client_body(raw: bytes) -> dict[str, Any]:
    """The client's JSON object. Raises ProtocolError for anything else (``NaN``/``Infinity``
    literals and nesting too deep to parse included)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ProtocolError("request body is nested too deeply") from exc
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    return body


def prefill_body(request: dict[str, Any]) -> dict[str, Any]:
    """What P gets: the client body with the prefill overrides (a new dict)."""
    body = dict(request)
    body["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body.pop("stream_options", None)
    body.pop("min_tokens", None)
    body.pop("min_completion_tokens", None)
    return body


def decode_bytes(raw: bytes, request: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> bytes:
    """:func:`decode_body` as the bytes D gets, without re-encoding the client's body: its own bytes
    (``raw``, which parsed as ``request``) with P's ``kv_transfer_params`` added as the last member.
    Encoded afresh when that cannot be done by splicing: the client sent ``kv_transfer_params`` itself
    (it is replaced), or ``raw`` is not a UTF-8 ``{...}`` with members."""
    if not kv_transfer_params:
        return raw
    body = raw.strip()
    if "kv_transfer_params" in request or not request or body[:1] != b"{" or body[-1:] != b"}":
        return json.dumps(decode_body(request, kv_transfer_params)).encode()
    return b"".join((body[:-1], b', "kv_transfer_params": ', json.dumps(kv_transfer_params).encode(), b"}"))


def decode_body(request: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """What D gets: the client body with P's ``kv_transfer_params`` (verbatim) when P sent any."""
    body = dict(request)
    if kv_transfer_params:
        body["kv_transfer_params"] = kv_transfer_params
    return body


def count_blocks(block_ids: Any) -> int:
    """Number of KV blocks in ``remote_block_ids``: one list per KV-cache group, or a flat list."""
    if not isinstance(block_ids, list):
        return 0
    total = 0
    for item in block_ids:
        total += len(item) if isinstance(item, list) else 1
    return total


def parse_prefill_answer(raw: bytes) -> PrefillAnswer:
    """Read what D needs (and what admission and tracing use) from P's JSON answer."""
    try:
        answer = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"prefill answer is not valid JSON: {exc}") from exc
    if not isinstance(answer, dict):
        raise ProtocolError("prefill answer is not a JSON object")
    params = answer.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise ProtocolError("prefill answer's kv_transfer_params is not an object")
    usage = answer.get("usage")
    prompt_tokens = 0
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        prompt_tokens = usage["prompt_tokens"]
    blocks = count_blocks(params.get("remote_block_ids")) if params else 0
    engine = params.get("remote_engine_id") if params else None
    return PrefillAnswer(
        kv_transfer_params=params,
        prompt_tokens=prompt_tokens,
        kv_blocks=blocks,
        remote_engine_id=str(engine) if engine is not None else None,
        cached_tokens=_cached_tokens(usage),
    )


def _count(value: Any) -> int | None:
    """A token count as vLLM reports it: a non-negative int, else nothing."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _cached_tokens(usage: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` (vLLM: prefix-cache hits, and on D the pulled
    tokens too), when the usage has it (``--enable-prompt-tokens-details``)."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    return _count(details.get("cached_tokens")) if isinstance(details, dict) else None


@dataclass(frozen=True, slots=True)
class Usage:
    """What the proxy reads of an answer's ``usage``: each count None when absent or not a count."""

    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


NO_USAGE = Usage()


def usage_of(raw: bytes) -> Usage:
    """The ``usage`` of a non-streamed answer (or of one streamed event)."""
    try:
        answer = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return NO_USAGE
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict):
        return NO_USAGE
    return Usage(
        _count(usage.get("completion_tokens")), _count(usage.get("prompt_tokens")), _cached_tokens(usage)
    )


def completion_tokens(raw: bytes) -> int | None:
    """``usage.completion_tokens`` of a non-streamed answer (or of one streamed event), if it has one."""
    return usage_of(raw).completion_tokens


def error_body(message: str, err_type: str, code: str | None = None, param: str | None = None) -> bytes:
    """An OpenAI-style error object."""
    return json.dumps(
        {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    ).encode()


def _event_with(data: bytes, marker: bytes) -> object:
    """One SSE ``data:`` payload, parsed, when ``marker`` is in it; None when it is not (the cheap
    test first: most events are tokens) or the payload is not JSON."""
    if marker not in data:
        return None
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def is_error_event(data: bytes) -> bool:
    """Whether one SSE ``data:`` payload is an in-band error: vLLM sends
    ``{"error": {...}}`` (older versions: ``{"object": "error", ...}``)."""
    event = _event_with(data, b'"error"')
    return isinstance(event, dict) and ("error" in event or event.get("object") == "error")


_PREAMBLE_DELTA_KEYS = frozenset(("role", "content", "reasoning_content", "reasoning"))


def is_preamble_event(data: bytes) -> bool:
    """Whether one SSE ``data:`` payload is vLLM's chat preamble, not a token: the chunk with
    the assistant ``role`` and empty content that vLLM sends with the first engine output --
    also when that output is an error (then the error event follows it)."""
    event = _event_with(data, b'"role"')
    choices = event.get("choices") if isinstance(event, dict) else None
    if not isinstance(choices, list) or not choices:
        return False
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict) or "role" not in delta or not set(delta) <= _PREAMBLE_DELTA_KEYS:
            return False
        if any(delta.get(k) for k in ("content", "reasoning_content", "reasoning")) or choice.get(
            "finish_reason"
        ):
            return False
    return True


class SseWatch:
    """Follows a streamed answer's server-sent events as its chunks go by (the bytes are
    forwarded unchanged; this only looks): token events seen, an in-band error, ``[DONE]``.
    vLLM's chat preamble (the role chunk) is not a token (:func:`is_preamble_event`).

    A line longer than ``max_line`` is not inspected (memory stays bounded); it still
    counts as a data event when it completes.
    """

    __slots__ = (
        "_carry",
        "_skipping",
        "cached_tokens",
        "completion_tokens",
        "done",
        "error",
        "events",
        "max_line",
        "prompt_tokens",
    )

    def __init__(self, max_line: int = 1 << 20) -> None:
        self.max_line = max_line
        self._carry = b""
        self._skipping = False
        self.events = 0  # data events that are neither an error, [DONE] nor the preamble
        self.error: bytes | None = None  # the first in-band error's payload
        self.done = False
        # usage.completion_tokens of the last event that had one (the client asked for
        # stream_options.include_usage); None when the stream carried no usage
        self.completion_tokens: int | None = None
        # the same event's usage.prompt_tokens and prompt_tokens_details.cached_tokens
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None

    def feed(self, chunk: bytes) -> None:
        if (
            self.events
            and not self._carry
            and not self._skipping
            and chunk.endswith(b"\n")
            and b'"error"' not in chunk
            and b'"completion_tokens"' not in chunk
            and b"[DONE]" not in chunk
            and len(chunk) <= self.max_line
        ):
            # Whole lines of plain token events after the first (the usual chunk): only count them.
            self.events += chunk.count(b"\ndata:") + chunk.startswith(b"data:")
            return
        data = self._carry + chunk if self._carry else chunk
        lines = data.split(b"\n")
        tail = lines.pop()
        for line in lines:
            if self._skipping:  # the end of an over-long line
                self._skipping = False
                self.events += 1
                continue
            self._line(line.rstrip(b"\r"))
        if len(tail) > self.max_line:
            self._skipping, self._carry = True, b""
        elif not self._skipping:
            self._carry = tail

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return  # blank separators, comments, event:/id: fields
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done = True
        elif is_error_event(payload):
            if self.error is None:
                self.error = payload
        elif not (self.events == 0 and is_preamble_event(payload)):
            self.events += 1
            if b'"completion_tokens"' in payload:  # only the usage events are parsed
                usage = usage_of(payload)
                if usage.completion_tokens is not None:
                    self.completion_tokens = usage.completion_tokens
                    self.prompt_tokens, self.cached_tokens = usage.prompt_tokens, usage.cached_tokens
