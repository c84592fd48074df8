"""The proxy's client side under hostile or broken HTTP: bounded reads (issue 13, low item) and
the probes that already held (slowloris, pipelining, smuggling, control-plane kills)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import httpx

from tests.proxy.conftest import fake_fleet, make_settings, running_proxy
from tests.support.controllers import FakeController, table
from tests.support.serving import serve
from tests.support.waiting import async_wait_until

COMPLETION = {"model": "fake", "prompt": "a b c", "max_tokens": 4}
BODY = json.dumps(COMPLETION).encode()


@asynccontextmanager
async def _raw(url: str) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        yield reader, writer
    finally:
        writer.close()


async def _closed_by_server(reader: asyncio.StreamReader, within_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes (fails if it does not close in time)."""
    return await asyncio.wait_for(reader.read(), within_s)


def _head(length: int, extra: str = "") -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    ).encode()


async def test_silent_partial_requests_are_closed_and_counted_while_others_are_served() -> None:
    async with fake_fleet(1, 1) as fleet:
        settings = make_settings(
            [fleet.prefill[0].url], [fleet.decode[0].url], proxy={"client_read_timeout_s": 0.3}
        )
        async with running_proxy(settings) as (url, _app), httpx.AsyncClient(timeout=10) as client:
            async with (
                _raw(url) as (r_idle, _w_idle),
                _raw(url) as (r_head, w_head),
                _raw(url) as (r_body, w_body),
            ):
                w_head.write(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nX-Slow: ")  # slowloris
                w_body.write(_head(len(BODY)) + BODY[:5])  # half a body, then silence
                await asyncio.gather(w_head.drain(), w_body.drain())
                # the proxy keeps serving everyone else meanwhile
                assert (await client.post(url + "/v1/completions", json=COMPLETION)).status_code == 200
                assert await _closed_by_server(r_idle) == b""  # connected, sent nothing
                assert await _closed_by_server(r_head) == b""
                assert await _closed_by_server(r_body) == b""
            metrics = (await client.get(url + "/metrics")).text
    assert 'pdscope_proxy_client_read_timeouts_total{phase="headers"} 2.0' in metrics
    assert 'pdscope_proxy_client_read_timeouts_total{phase="body"} 1.0' in metrics
    assert len(fleet.prefill[0].calls) == 1  # the half request never reached P


async def test_the_read_bound_ends_when_the_request_is_in_a_long_stream_is_not_cut() -> None:
    async with fake_fleet(1, 1, n_chunks=5, chunk_delay=0.2) as fleet:
        settings = make_settings(
            [fleet.prefill[0].url], [fleet.decode[0].url], proxy={"client_read_timeout_s": 0.3}
        )
        async with running_proxy(settings) as (url, _app), httpx.AsyncClient(timeout=10) as client:
            resp = await client.post(url + "/v1/completions", json={**COMPLETION, "stream": True})
            again = await client.post(url + "/v1/completions", json=COMPLETION)  # same keep-alive connection
            metrics = (await client.get(url + "/metrics")).text
    assert resp.status_code == 200 and resp.text.rstrip().endswith("data: [DONE]")
    assert again.status_code == 200
    assert "pdscope_proxy_client_read_timeouts_total{" not in metrics


async def test_pipelined_requests_are_answered_in_order() -> None:
    async with fake_fleet(1, 1) as fleet:
        settings = make_settings([fleet.prefill[0].url], [fleet.decode[0].url])
        async with running_proxy(settings) as (url, _app), _raw(url) as (reader, writer):
            bodies = [
                json.dumps({**COMPLETION, "prompt": p, "max_tokens": 16}).encode()
                for p in ("one two", "three four five")
            ]
            writer.write(
                b"".join(_head(len(b)) + b for b in bodies)
                + b"GET /healthz HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n\r\n"
            )
            await writer.drain()
            raw = await _closed_by_server(reader)
    answers = raw.split(b"HTTP/1.1 ")[1:]
    assert [a[:3] for a in answers] == [b"200", b"200", b"200"]
    assert b"owt eno" in answers[0] and b"evif ruof" in answers[1]  # the fake D reverses the prompt
    assert len(fleet.prefill[0].calls) == 2


async def test_smuggling_shapes_are_refused_before_the_flow() -> None:
    probes = [
        _head(len(BODY), "Transfer-Encoding: chunked\r\n") + BODY,  # CL.TE
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n"
            + BODY
        ),  # two lengths
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
        ),  # bad chunk
        (b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nTransfer-Encoding: xchunked\r\n\r\n" + BODY),
    ]
    async with fake_fleet(1, 1) as fleet:
        settings = make_settings([fleet.prefill[0].url], [fleet.decode[0].url])
        async with running_proxy(settings) as (url, _app):
            for probe in probes:
                async with _raw(url) as (reader, writer):
                    writer.write(probe)
                    await writer.drain()
                    raw = await _closed_by_server(reader)
                assert raw.startswith(b"HTTP/1.1 400") or raw.startswith(b"HTTP/1.1 501"), (probe, raw[:80])
    assert fleet.prefill[0].calls == []


async def test_the_controller_killed_under_load_costs_no_client_request() -> None:
    async with fake_fleet(2, 2) as fleet:
        p, d = fleet.prefill, fleet.decode
        ctl = FakeController(
            table(
                [
                    ("p0", "prefill", "prefill", p[0].url, 1.0, False),
                    ("p1", "prefill", "prefill", p[1].url, 1.0, False),
                    ("d0", "decode", "decode", d[0].url, 1.0, False),
                    ("d1", "decode", "decode", d[1].url, 1.0, False),
                ]
            )
        )
        statuses: list[int] = []
        async with AsyncExitStack() as controller:
            ctl_url = await controller.enter_async_context(serve(ctl.app()))
            settings = make_settings(
                [x.url for x in p],
                [x.url for x in d],
                proxy={"controller_url": ctl_url, "fail_static_s": 0.5},
            )
            async with running_proxy(settings) as (url, app), httpx.AsyncClient(timeout=10) as client:
                routing = app.parts.routing
                await async_wait_until("a fresh routing table", lambda: routing.state == "fresh")
                seen: list[str] = []

                done = asyncio.Event()

                async def load() -> None:
                    while not done.is_set():
                        r = await client.post(url + "/v1/completions", json={**COMPLETION, "stream": True})
                        statuses.append(r.status_code)
                        seen.append(routing.state)

                async with asyncio.TaskGroup() as tg:
                    for _ in range(4):
                        tg.create_task(load())
                    await async_wait_until("40 answers", lambda: len(statuses) >= 40)
                    await controller.aclose()  # the controller process is gone: connection refused
                    await async_wait_until("the routing fallback", lambda: routing.state == "fallback")
                    after = len(statuses)
                    await async_wait_until("20 answers more", lambda: len(statuses) >= after + 20)
                    done.set()
    assert statuses == [200] * len(statuses) and len(statuses) >= 60
    assert {"fresh", "fallback"} <= set(seen)  # traffic ran through the kill and the fallback
