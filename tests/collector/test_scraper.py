"""The scraper against in-test HTTP servers that misbehave in every way the issue lists."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from collector.scraper import Scraper, ScrapeResult, scrape_one
from collector.selfmetrics import CollectorMetrics
from collector.targets import Target
from tests.captures import SCRAPE_PAGES
from tests.ports import free_port

FIXTURES = SCRAPE_PAGES
DECODE = (FIXTURES / "decode_metrics.txt").read_bytes()

Handler = Callable[[asyncio.StreamWriter], Awaitable[None]]


def _headers(status: str, length: int | None, ctype: str = "text/plain; version=0.0.4") -> bytes:
    h = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
    h += f"Content-Length: {length}\r\n" if length is not None else "Connection: close\r\n"
    return (h + "\r\n").encode()


async def _ok(w: asyncio.StreamWriter, body: bytes = DECODE) -> None:
    w.write(_headers("200 OK", len(body)) + body)


async def _error500(w: asyncio.StreamWriter) -> None:
    body = b"internal error"
    w.write(_headers("500 Internal Server Error", len(body)) + body)


async def _huge(w: asyncio.StreamWriter) -> None:
    size = 10 * 2**20
    w.write(_headers("200 OK", size))
    chunk = b"# filler\n" * 10_000
    sent = 0
    while sent < size:
        w.write(chunk)
        sent += len(chunk)
        await w.drain()


async def _drip(w: asyncio.StreamWriter) -> None:
    w.write(_headers("200 OK", len(DECODE)))
    for b in DECODE:
        w.write(bytes([b]))
        await w.drain()
        await asyncio.sleep(1.0)


async def _garbage(w: asyncio.StreamWriter) -> None:
    body = bytes(range(256)) * 40
    w.write(_headers("200 OK", len(body)) + body)


async def _non_utf8(w: asyncio.StreamWriter) -> None:
    await _ok(w, DECODE.replace(b'model_name="tiny"', b'model_name="t\xe9ny"'))


async def _silent(w: asyncio.StreamWriter) -> None:
    await asyncio.sleep(30)


HANDLERS: dict[str, Handler] = {
    "ok": _ok,
    "500": _error500,
    "huge": _huge,
    "drip": _drip,
    "garbage": _garbage,
    "nonutf8": _non_utf8,
    "silent": _silent,
}


@pytest.fixture
async def server() -> AsyncIterator[str]:
    """One HTTP/1.1 server on a free port; the path picks the behaviour: /ok/metrics, /drip/metrics..."""
    tasks: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tasks.add(asyncio.current_task())  # type: ignore[arg-type]
        try:
            while True:
                request = await reader.readuntil(b"\r\n\r\n")
                path = request.split(b" ", 2)[1].decode()
                await HANDLERS[path.strip("/").split("/")[0]](writer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.close()
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _target(name: str, url: str) -> Target:
    return Target(name, "pool", "decode", url, url)


async def _one(base: str, kind: str, limit_s: float = 2.0, cap: int = 8 * 2**20) -> ScrapeResult:
    async with httpx.AsyncClient() as client:
        return await scrape_one(client, _target(kind, f"{base}/{kind}/metrics"), limit_s, cap)


async def test_good_page(server: str) -> None:
    r = await _one(server, "ok")
    assert r.up and r.error is None
    assert r.signals is not None and r.signals.values["nixl_xfer_time_count"] == 23.0
    assert r.body_bytes == len(DECODE)


async def test_http_500(server: str) -> None:
    r = await _one(server, "500")
    assert not r.up and r.error == "HTTP 500"


async def test_ten_megabyte_page_is_cut_at_the_cap(server: str) -> None:
    r = await _one(server, "huge", limit_s=5.0, cap=8 * 2**20)
    assert not r.up and r.error is not None and "larger than" in r.error
    assert r.duration_s < 5.0


async def test_one_byte_a_second_is_cut_at_the_timeout(server: str) -> None:
    r = await _one(server, "drip", limit_s=1.5)
    assert not r.up and r.error == "timeout after 1.5s"
    assert 1.4 <= r.duration_s < 3.0


async def test_garbage_page_is_down_with_a_reason(server: str) -> None:
    r = await _one(server, "garbage")
    assert not r.up and r.error is not None and r.error.startswith("no vLLM metrics on the page")


async def test_non_utf8_page_is_up_and_reported(server: str) -> None:
    r = await _one(server, "nonutf8")
    assert r.up and r.signals is not None
    assert r.signals.values["requests_length"] == 23.0
    assert any("UTF-8" in e for e in r.signals.errors)


async def test_dead_port() -> None:
    url = f"http://127.0.0.1:{free_port()}/metrics"
    async with httpx.AsyncClient() as client:
        r = await scrape_one(client, _target("dead", url), 2.0, 2**20)
    assert not r.up and r.error is not None and "ConnectError" in r.error


async def test_one_bad_target_never_delays_the_others(server: str) -> None:
    """A round with every bad kind: the good targets finish as fast as alone; the round is bounded."""
    kinds = ["drip", "silent", "huge", "500", "garbage", "nonutf8", "ok", "ok"]
    targets = [_target(f"{k}-{i}", f"{server}/{k}/metrics") for i, k in enumerate(kinds)]
    targets.append(_target("dead", f"http://127.0.0.1:{free_port()}/metrics"))
    rounds: list[list[ScrapeResult]] = []

    async def on_round(results: list[ScrapeResult]) -> None:
        rounds.append(results)

    async with httpx.AsyncClient() as client:
        alone = await scrape_one(client, targets[6], 2.0, 8 * 2**20)
        scraper = Scraper(
            targets, client, interval_s=3.0, timeout_s=2.0, max_body_bytes=8 * 2**20, on_round=on_round, jitter_s=0.0
        )
        start = time.perf_counter()
        results = await scraper.scrape_round()
        elapsed = time.perf_counter() - start
    by = {r.target.name: r for r in results}
    assert [r.target.name for r in results] == [t.name for t in targets]
    # the slow ones hit the timeout; the round takes about one timeout, not the sum of them
    assert by["drip-0"].error == "timeout after 2s" and by["silent-1"].error == "timeout after 2s"
    assert elapsed < 2.0 + 1.5
    good = [by["ok-6"], by["ok-7"], by["nonutf8-5"]]
    assert all(r.up for r in good)
    # good targets were not held up by the slow ones: each finished long before the timeout
    slowest_good = max(r.duration_s for r in good)
    assert slowest_good < by["drip-0"].duration_s / 2
    assert slowest_good < alone.duration_s + 1.0
    metrics = CollectorMetrics()
    metrics.observe_round(results)
    text = metrics.exposition().decode()
    assert 'pdscope_collector_target_up{instance="ok-6",pool="pool",role="decode"} 1.0' in text
    assert 'pdscope_collector_target_up{instance="drip-0",pool="pool",role="decode"} 0.0' in text
    assert 'pdscope_collector_target_last_error{error="HTTP 500",instance="500-3"} 1.0' in text
    assert 'pdscope_collector_scrape_duration_seconds{instance="ok-6"}' in text


async def test_run_loop_keeps_cadence_and_stops(server: str) -> None:
    rounds: list[float] = []

    async def on_round(results: list[ScrapeResult]) -> None:
        rounds.append(time.perf_counter())

    stop = asyncio.Event()
    async with httpx.AsyncClient() as client:
        scraper = Scraper(
            [_target("ok", f"{server}/ok/metrics"), _target("drip", f"{server}/drip/metrics")],
            client,
            interval_s=0.6,
            timeout_s=0.4,
            max_body_bytes=2**20,
            on_round=on_round,
        )
        task = asyncio.create_task(scraper.run(stop))
        await asyncio.sleep(2.0)
        stop.set()
        await asyncio.wait_for(task, timeout=3.0)
    assert 3 <= len(rounds) <= 5
    gaps = [b - a for a, b in itertools.pairwise(rounds)]
    assert all(0.3 < g < 1.2 for g in gaps)


def test_timeout_must_be_below_interval() -> None:
    with pytest.raises(ValueError):
        Scraper([], httpx.AsyncClient(), interval_s=1.0, timeout_s=1.0, max_body_bytes=1, on_round=None)  # type: ignore[arg-type]
