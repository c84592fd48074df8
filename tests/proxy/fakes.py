"""Small in-test upstreams for the proxy: fake vLLM P and D servers and a fake controller.

They speak the same wire protocol as vLLM's NIXL pull mode (P answers with
``kv_transfer_params``; D insists on them) and record what they received, so tests
can check exactly what the proxy sent. Served by uvicorn on a pre-bound 127.0.0.1:0
socket inside the test's event loop.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.ports import free_port


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # asyncio sets TCP_NODELAY only then
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def closed_port_url() -> str:
    """A URL nothing listens on (connection refused)."""
    return f"http://127.0.0.1:{free_port()}"


@asynccontextmanager
async def serve(
    app: Any, stop_timeout_s: float = 5, http: Any = "httptools", sock: socket.socket | None = None
) -> AsyncIterator[str]:
    """Run an ASGI app on a free port (or on ``sock``, bound and not yet listening) in this loop;
    yields its base URL."""
    sock = sock or free_socket()
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="error", access_log=False, lifespan="on", http=http,
                            timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    for _ in range(500):
        if server.started:
            break
        await asyncio.sleep(0.01)
    assert server.started, "test server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(task, stop_timeout_s)
        except TimeoutError:
            task.cancel()
        sock.close()


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
    the first token, ``"empty"`` ends the stream before any event; ``no_done`` ends the stream cleanly without ``data: [DONE]``."""

    name: str
    role: str
    mode: str = "ok"
    chunk_delay: float = 0.0
    n_chunks: int = 4
    hang_after_first: bool = False
    stream_error: str = ""
    no_done: bool = False
    calls: list[dict[str, Any]] = field(default_factory=list)
    aborted: int = 0
    finished: int = 0
    url: str = ""

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/completions", self._handle, methods=["POST"]),
            Route("/v1/chat/completions", self._handle, methods=["POST"]),
        ])

    async def _handle(self, request: Request) -> Response:
        body = await request.json()
        self.calls.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
        if self.mode == "hang":
            await asyncio.sleep(3600)
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
        if not isinstance(ktp, dict) or ktp.get("do_remote_prefill") is not True:
            return 422, {"error": {"message": "no kv_transfer_params"}}
        if body.get("stream"):
            return 200, None
        self.finished += 1
        text = completion_text(body)
        choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text}}
                                  if "messages" in body else {"index": 0, "text": text})
        choice["finish_reason"] = "length"
        return 200, {"id": f"cmpl-{rid}", "choices": [choice],
                     "usage": {"prompt_tokens": 3, "completion_tokens": len(text)}}

    def prefill_answer(self, rid: str, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body.get("prompt") or json.dumps(body.get("messages"))
        n_tokens = len(str(prompt).split())
        return {
            "id": f"cmpl-{rid}-0",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": {"prompt_tokens": n_tokens, "completion_tokens": 1, "total_tokens": n_tokens + 1},
            "kv_transfer_params": {
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [[1, 2, 3]], "remote_engine_id": f"engine-{self.name}",
                "remote_request_id": f"cmpl-{rid}-0-deadbeef", "remote_host": "127.0.0.1",
                "remote_port": 5600, "tp_size": 1, "remote_num_tokens": n_tokens, "transfer_mode": "pull",
            },
        }

    async def events(self, rid: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        """D's SSE stream for a streamed decode (``aborted`` counts streams closed before the end)."""
        text = completion_text(body)
        chat = "messages" in body
        n = max(1, self.n_chunks)
        size = max(1, -(-len(text) // n))
        pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
        error_event = b"data: " + json.dumps({"error": {
            "message": "KV transfer failed", "type": "InternalServerError", "param": None, "code": 500,
        }}).encode() + b"\n\n"
        try:
            if chat:  # vLLM's chat preamble, sent with the first engine output (an error too)
                yield b"data: " + json.dumps({"id": rid, "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}).encode() \
                    + b"\n\n"
            if self.stream_error == "first":
                yield error_event + b"data: [DONE]\n\n"
                return
            if self.stream_error == "empty":  # a 200 and no event at all
                return
            for i, piece in enumerate(pieces):
                delta = {"delta": {"content": piece}} if chat else {"text": piece}
                yield b"data: " + json.dumps({"id": rid, "choices": [{"index": 0, **delta}]}).encode() + b"\n\n"
                if self.hang_after_first and i == 0:
                    await asyncio.sleep(3600)
                if self.stream_error == "mid" and i == 0:
                    yield error_event + b"data: [DONE]\n\n"
                    return
                if self.chunk_delay:
                    await asyncio.sleep(self.chunk_delay)
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


@dataclass
class FakeController:
    """Serves a routing table with an ETag; ``table`` may be swapped; ``down`` answers 503."""

    table: dict[str, Any]
    down: bool = False
    gets: int = 0
    not_modified: int = 0

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/routing", self._routing)])

    async def _routing(self, request: Request) -> Response:
        self.gets += 1
        if self.down:
            return JSONResponse({"error": "down"}, status_code=503)
        etag = f'"{self.table["version"]}"'
        if request.headers.get("if-none-match") == etag:
            self.not_modified += 1
            return Response(status_code=304, headers={"ETag": etag})
        return JSONResponse(self.table, headers={"ETag": etag})


def table(
    instances: list[tuple[str, str, str, str, float, bool]],
    version: int = 1,
    enforce: bool = True,
    pools: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A routing table: instances as (name, pool, role, url, weight, drained)."""
    return {
        "version": version, "generated_at": 0.0, "mode": "enforce" if enforce else "advisory",
        "enforce": enforce,
        "instances": [
            {"name": n, "pool": p, "role": r, "url": u, "weight": w, "drained": d}
            for n, p, r, u, w, d in instances
        ],
        "pools": pools or [],
    }
