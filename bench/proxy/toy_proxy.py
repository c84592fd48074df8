"""The benchmark's baseline: a proxy equivalent to vLLM's NIXL toy proxy (our own code).

Same libraries and protocol as ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``:
FastAPI, one ``httpx.AsyncClient`` per instance (no timeout), P and D picked round-robin,
one ``X-Request-Id`` (uuid4) to both, the prefill overrides, P's ``kv_transfer_params``
to D, and D's bytes streamed back through ``StreamingResponse``; served by
``uvicorn.run`` with its defaults (as the toy is, so the access log is on). No features:
no admission, retries, tracing, metrics or routing table.

Run: ``python -m bench.proxy.toy_proxy --port 8192 --prefill URL [URL ...] --decode URL [URL ...]``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from proxy.protocol import prefill_body


def make_app(prefill_urls: list[str], decode_urls: list[str]) -> FastAPI:
    app = FastAPI()
    prefill = itertools.cycle([httpx.AsyncClient(base_url=u, timeout=None) for u in prefill_urls])
    decode = itertools.cycle([httpx.AsyncClient(base_url=u, timeout=None) for u in decode_urls])

    def headers(request_id: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY')}", "X-Request-Id": request_id}

    async def handle(path: str, request: Request) -> StreamingResponse:
        req_data: dict[str, Any] = await request.json()
        request_id = str(uuid.uuid4())
        p_data = prefill_body(req_data)  # the prefill overrides, as the toy applies them
        p_client = next(prefill)
        p_resp = await p_client.post(path, json=p_data, headers=headers(request_id))
        p_resp.raise_for_status()
        kv_transfer_params = p_resp.json().get("kv_transfer_params", {})
        if kv_transfer_params:
            req_data["kv_transfer_params"] = kv_transfer_params
        d_client = next(decode)

        async def generate() -> AsyncIterator[bytes]:
            async with d_client.stream("POST", path, json=req_data, headers=headers(request_id)) as resp:
                resp.raise_for_status()
                async for chunk in resp.aiter_bytes():
                    yield chunk

        return StreamingResponse(generate(), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        return await handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        return await handle("/v1/chat/completions", request)

    @app.get("/healthcheck")
    async def healthcheck() -> dict[str, str]:
        return {"status": "ok"}

    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8192)
    ap.add_argument("--prefill", nargs="+", required=True)
    ap.add_argument("--decode", nargs="+", required=True)
    a = ap.parse_args()
    uvicorn.run(make_app(a.prefill, a.decode), host=a.host, port=a.port)
