"""Small in-test upstreams for the proxy: fake vLLM P and D servers.

They speak the same wire protocol as vLLM's NIXL pull mode (P answers with
``kv_transfer_params``; D insists on them) and record what they received, so tests
can check exactly what the proxy sent. Serve them with :func:`tests.support.serving.serve`;
the fake controller is :class:`tests.support.controllers.FakeController`. :class:`FakeView` is
a cache view (``proxy.prefixview.CacheView``) with fixed holdings, for KV-aware routing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from proxy.prefixview import Prompt


def completion_text(body: dict[str, Any]) -> str:
    """D's deterministic 'generation' for a request."""
    prompt = body.get("prompt")
    if prompt is None:
        prompt = " ".join(str(m.get("content", "")) for m in body.get("messages", []))
    return "".join(reversed(str(prompt)))[: int(body.get("max_tokens") or 16)]


@dataclass
class FakeVLLM:
    """One fake vLLM instance. ``mode``: ok, error500, error503, error400, error429, hang.

    Streams (decode): ``stream_error`` ``"first"`` sends vLLM's in-band error event
    (``data: {"error": {...}}``, then ``[DONE]``) instead of any token, ``"mid"`` sends it after
    the first token, ``"empty"`` ends the stream before any event; ``no_done`` ends the stream
    cleanly without ``data: [DONE]``. ``serves_plain``: a D that answers a request without
    ``kv_transfer_params`` by computing the prompt itself, as vLLM does (the decode-only path);
    ``cached_tokens``: reported in ``usage.prompt_tokens_details`` (vLLM's prefix-cache hits)."""

    name: str
    role: str
    mode: str = "ok"
    chunk_delay: float = 0.0
    n_chunks: int = 4
    hang_after_first: bool = False
    stream_error: str = ""
    no_done: bool = False
    serves_plain: bool = False
    cached_tokens: int | None = None
    model: str = "fake"  # what GET /v1/models lists, with max_model_len
    max_model_len: int = 4096
    models_status: int = 200  # GET /v1/models answers this status (200: the model list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    aborted: int = 0
    finished: int = 0
    url: str = ""

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/completions", self._handle, methods=["POST"]),
                Route("/v1/chat/completions", self._handle, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/version", self._version, methods=["GET"]),
            ]
        )

    async def _models(self, request: Request) -> Response:
        """vLLM's /v1/models shape (``vllm/entrypoints/openai``: a list of model cards)."""
        if self.models_status != 200:
            return JSONResponse({"detail": "Not Found"}, status_code=self.models_status)
        card = {
            "id": self.model,
            "object": "model",
            "created": 1700000000,
            "owned_by": "vllm",
            "root": self.model,
            "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [],
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def _version(self, request: Request) -> Response:
        return JSONResponse({"version": "0.32.0"})

    async def _handle(self, request: Request) -> Response:
        body = await request.json()
        self.calls.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
        if self.mode == "hang":
            await asyncio.sleep(3600)  # the behaviour under test: an upstream that never answers
        rid = request.headers.get("x-request-id", "none")
        status, payload = self.answer(rid, body)
        if payload is None:
            return StreamingResponse(self.events(rid, body), media_type="text/event-stream")
        return JSONResponse(payload, status_code=status)

    # -- what it answers (shared with the in-memory fleet, tests/proxy/memory.py) -----------

    def answer(self, rid: str, body: dict[str, Any]) -> tuple[int, dict[str, Any] | None]:
        """(status, JSON body) for one call, or (200, None) for a stream (:meth:`events`)."""
        refused = REFUSALS.get(self.mode)
        if refused is not None:
            return refused
        if self.role == "prefill":
            return 200, self.prefill_answer(rid, body)
        ktp = body.get("kv_transfer_params")
        plain = self.serves_plain and ktp is None
        if not plain and (not isinstance(ktp, dict) or ktp.get("do_remote_prefill") is not True):
            return 422, {"error": {"message": "no kv_transfer_params"}}
        if body.get("stream"):
            return 200, None
        self.finished += 1
        text = completion_text(body)
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}}
            if "messages" in body
            else {"index": 0, "text": text}
        )
        choice["finish_reason"] = "length"
        return 200, {
            "id": f"cmpl-{rid}",
            "choices": [choice],
            "usage": self._usage({"prompt_tokens": 3, "completion_tokens": len(text)}),
        }

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage

    def prefill_answer(self, rid: str, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body.get("prompt") or json.dumps(body.get("messages"))
        n_tokens = len(str(prompt).split())
        return {
            "id": f"cmpl-{rid}-0",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": self._usage(
                {"prompt_tokens": n_tokens, "completion_tokens": 1, "total_tokens": n_tokens + 1}
            ),
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [[1, 2, 3]],
                "remote_engine_id": f"engine-{self.name}",
                "remote_request_id": f"cmpl-{rid}-0-deadbeef",
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
                "tp_size": 1,
                "remote_num_tokens": n_tokens,
                "transfer_mode": "pull",
            },
        }

    async def events(self, rid: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        """D's SSE stream for a streamed decode (``aborted`` counts streams closed before the end)."""
        text = completion_text(body)
        chat = "messages" in body
        n = max(1, self.n_chunks)
        size = max(1, -(-len(text) // n))
        pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
        error_event = (
            b"data: "
            + json.dumps(
                {
                    "error": {
                        "message": "KV transfer failed",
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
                    }
                }
            ).encode()
            + b"\n\n"
        )
        try:
            if chat:  # vLLM's chat preamble, sent with the first engine output (an error too)
                yield (
                    b"data: "
                    + json.dumps(
                        {
                            "id": rid,
                            "choices": [
                                {
                                    "index": 0,
                                    "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None,
                                }
                            ],
                        }
                    ).encode()
                    + b"\n\n"
                )
            if self.stream_error == "first":
                yield error_event + b"data: [DONE]\n\n"
                return
            if self.stream_error == "empty":  # a 200 and no event at all
                return
            for i, piece in enumerate(pieces):
                delta = {"delta": {"content": piece}} if chat else {"text": piece}
                yield (
                    b"data: " + json.dumps({"id": rid, "choices": [{"index": 0, **delta}]}).encode() + b"\n\n"
                )
                if self.hang_after_first and i == 0:
                    await asyncio.sleep(3600)  # the behaviour under test: a stream that stalls
                if self.stream_error == "mid" and i == 0:
                    yield error_event + b"data: [DONE]\n\n"
                    return
                if self.chunk_delay:
                    await asyncio.sleep(self.chunk_delay)  # the behaviour under test: a slow decode
            if (body.get("stream_options") or {}).get("include_usage"):  # vLLM's usage event
                usage = self._usage(
                    {"prompt_tokens": 3, "completion_tokens": len(text), "total_tokens": 3 + len(text)}
                )
                yield b"data: " + json.dumps({"id": rid, "choices": [], "usage": usage}).encode() + b"\n\n"
            if not self.no_done:
                yield b"data: [DONE]\n\n"
            self.finished += 1
        except BaseException:
            self.aborted += 1
            raise


REFUSALS: dict[str, tuple[int, dict[str, Any]]] = {
    "error500": (500, {"error": {"message": "boom"}}),
    "error503": (503, {"error": {"message": "queue full"}}),
    "error429": (429, {"error": {"message": "too many requests", "type": "RateLimitError"}}),
    "error400": (400, {"error": {"message": "bad prompt", "type": "BadRequestError"}}),
}


BLOCK = 16


class FakeView:
    """A cache view with fixed holdings: every keyed prompt is ``tokens`` long; ``fail`` names the
    call that raises; a prompt of ``"unkeyable"`` is not keyed."""

    def __init__(self, held: Mapping[str, int], tokens: int = 1024, fail: str | None = None) -> None:
        self.held, self.tokens, self.fail = dict(held), tokens, fail
        self.routed_to: list[list[str]] = []

    def prompt(self, endpoint: str, body: Mapping[str, Any]) -> Prompt | None:
        if self.fail == "prompt":
            raise RuntimeError("view bug")
        if body.get("prompt") == "unkeyable":
            return None
        keys = tuple(i.to_bytes(4, "big") * 4 for i in range(self.tokens // BLOCK))
        return Prompt(keys=keys, tokens=self.tokens, block_tokens=BLOCK)

    def cached(self, prompt: Prompt, instances: Sequence[str]) -> dict[str, int]:
        if self.fail == "cached":
            raise RuntimeError("view bug")
        return {name: self.held.get(name, 0) for name in instances}

    def routed(self, prompt: Prompt, instances: Sequence[str], now: float) -> None:
        if self.fail == "routed":
            raise RuntimeError("view bug")
        self.routed_to.append(list(instances))
