"""The load generator's HTTP/1.1 client against the simulator's uvicorn servers."""

from __future__ import annotations

import asyncio

import pytest

from simulator.httpclient import HttpClientError, Pool
from simulator.testing import running_fleet
from tests.support.sockets import free_port


def test_json_and_sse_bodies_and_connection_reuse() -> None:
    with running_fleet(1, 1, latency_scale=0.0) as fleet:
        url = fleet.decode_urls[0] + "/v1/completions"

        async def go() -> None:
            pool = Pool()
            body = {"model": fleet.model_name, "prompt": "a b c", "max_tokens": 3}
            async with pool.post(url, body, {"X-Request-Id": "h1"}) as r:
                data = await r.json()
            assert (
                r.status_code == 200 and data["id"] == "cmpl-h1" and data["usage"]["completion_tokens"] == 3
            )
            async with pool.post(url, {**body, "stream": True}) as r:
                lines = [line async for line in r.aiter_lines() if line]
            assert r.headers["content-type"].startswith("text/event-stream")
            assert lines[-1] == "data: [DONE]" and len(lines) == 4
            async with pool.post(url, {**body, "model": "nope"}) as r:
                assert r.status_code == 404 and "error" in await r.json()
            assert sum(len(v) for v in pool._idle.values()) == 1  # one connection, reused every time
            await pool.aclose()

        asyncio.run(go())


def test_refused_connection_is_a_client_error() -> None:
    port = free_port()

    async def go() -> None:
        async with Pool().post(f"http://127.0.0.1:{port}/v1/completions", {}):
            pass

    with pytest.raises(HttpClientError, match="connect"):
        asyncio.run(go())
