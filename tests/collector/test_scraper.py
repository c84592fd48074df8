"""The scraper against in-test HTTP servers that misbehave in every way the issue lists,
and its run loop's cadence on a clock the test drives."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from collector.scraper import Scraper, ScrapeResult, scrape_one
from collector.selfmetrics import CollectorMetrics
from collector.targets import ScrapeTarget
from store.models import UNREACHABLE
from tests.captures import SCRAPE_PAGES
from tests.support.sockets import free_port
from tests.support.waiting import async_wait_until

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
        await asyncio.sleep(1.0)  # the slowness is the behaviour under test: one byte a second


async def _garbage(w: asyncio.StreamWriter) -> None:
    body = bytes(range(256)) * 40
    w.write(_headers("200 OK", len(body)) + body)


async def _non_utf8(w: asyncio.StreamWriter) -> None:
    await _ok(w, DECODE.replace(b'model_name="tiny"', b'model_name="t\xe9ny"'))


async def _silent(w: asyncio.StreamWriter) -> None:
    await asyncio.sleep(30)  # the behaviour under test: a target that never answers


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


def _target(name: str, url: str) -> ScrapeTarget:
    return ScrapeTarget(name, "pool", "decode", url, url)


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
    # cut at the cap, not at the deadline (that would read "timeout after 5s")
    assert not r.up and r.error == f"body larger than {8 * 2**20} bytes"


async def test_one_byte_a_second_is_cut_at_the_timeout(server: str) -> None:
    r = await _one(server, "drip", limit_s=1.5)
    # the whole-scrape deadline, not a per-read timeout (each byte arrives well within one)
    assert not r.up and r.error == "timeout after 1.5s"
    assert r.duration_s >= 1.4  # the duration reported covers the wait (a lower bound: cannot flake)


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
    assert not r.up and r.error is not None and r.error.startswith(UNREACHABLE + "ConnectError")


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
            targets,
            client,
            interval_s=3.0,
            timeout_s=2.0,
            max_body_bytes=8 * 2**20,
            on_round=on_round,
            jitter_s=0.0,
        )
        start = time.perf_counter()
        results = await scraper.scrape_round()
        elapsed = time.perf_counter() - start
    by = {r.target.name: r for r in results}
    assert [r.target.name for r in results] == [t.name for t in targets]
    # the slow ones hit the timeout; run one after the other, the round would take at least the
    # sum of the two: together, it takes about one (compared with what was measured, no fixed bound)
    assert by["drip-0"].error == "timeout after 2s" and by["silent-1"].error == "timeout after 2s"
    assert elapsed < by["drip-0"].duration_s + by["silent-1"].duration_s
    good = [by["ok-6"], by["ok-7"], by["nonutf8-5"]]
    assert all(r.up for r in good) and alone.up
    # good targets were not held up by the slow ones: each finished long before the timeout
    assert max(r.duration_s for r in good) < by["drip-0"].duration_s / 2
    metrics = CollectorMetrics()
    metrics.observe_round(results)
    text = metrics.exposition().decode()
    assert 'pdscope_collector_target_up{instance="ok-6",pool="pool",role="decode"} 1.0' in text
    assert 'pdscope_collector_target_up{instance="drip-0",pool="pool",role="decode"} 0.0' in text
    assert 'pdscope_collector_target_last_error{error="HTTP 500",instance="500-3"} 1.0' in text
    assert 'pdscope_collector_scrape_duration_seconds{instance="ok-6"}' in text


class FakeTime:
    """The scraper's clock and sleep, driven by the test: a sleep advances the clock at once."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)  # one turn of the loop, as a real sleep gives


def _costly_client(fake: FakeTime, costs: list[float]) -> httpx.AsyncClient:
    """A client whose n-th scrape takes ``costs[n]`` seconds of the fake clock (the last one after)."""
    calls = 0

    def handler(_request: httpx.Request) -> httpx.Response:
        nonlocal calls
        fake.now += costs[min(calls, len(costs) - 1)]
        calls += 1
        return httpx.Response(200, content=DECODE)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def _run_rounds(
    costs: list[float], n_rounds: int, interval_s: float = 1.0
) -> tuple[list[float], FakeTime]:
    """Run the loop for ``n_rounds`` rounds on fake time; returns when each round started."""
    fake, started = FakeTime(), []
    rounds: list[list[ScrapeResult]] = []
    stop = asyncio.Event()

    async def on_round(results: list[ScrapeResult]) -> None:
        rounds.append(results)
        if len(started) == n_rounds:
            stop.set()

    async with _costly_client(fake, costs) as client:
        scraper = Scraper(
            [_target("ok", "http://d0/metrics")],
            client,
            interval_s=interval_s,
            timeout_s=0.5,
            max_body_bytes=2**20,
            on_round=on_round,
            jitter_s=0.0,
            on_tick=lambda: started.append(fake.now),
            clock=fake.clock,
            sleep=fake.sleep,
        )
        await asyncio.wait_for(scraper.run(stop), timeout=10)  # a guard against a hang, not a bound
    assert scraper.rounds == len(rounds) == n_rounds
    assert all(r.up for results in rounds for r in results), [r.error for results in rounds for r in results]
    return started, fake


async def test_run_loop_keeps_its_cadence_whatever_a_round_costs() -> None:
    started, fake = await _run_rounds([0.25], n_rounds=4)
    assert started == [0.0, 1.0, 2.0, 3.0]
    assert fake.sleeps[:3] == [0.75, 0.75, 0.75]  # the interval less what the round took


async def test_run_loop_that_fell_behind_skips_the_missed_slots() -> None:
    started, fake = await _run_rounds([2.5, 0.25], n_rounds=4)
    # the first round overran two slots: the next starts at once, the cadence goes on from there
    assert started == [0.0, 2.5, 3.5, 4.5]
    assert fake.sleeps[:3] == [0.0, 0.75, 0.75]


async def test_jitter_is_drawn_from_the_rng_and_slept_on_the_clock() -> None:
    fake = FakeTime()
    expected = random.Random(7).uniform(0, 0.3)
    async with _costly_client(fake, [0.0]) as client:
        scraper = Scraper(
            [_target("ok", "http://d0/metrics")],
            client,
            interval_s=3.0,
            timeout_s=2.0,
            max_body_bytes=2**20,
            on_round=_noop,
            jitter_s=0.3,
            rng=random.Random(7),
            clock=fake.clock,
            sleep=fake.sleep,
        )
        (result,) = await scraper.scrape_round()
    assert result.up and fake.sleeps == [expected] and 0 < expected < 0.3


async def _noop(_results: list[ScrapeResult]) -> None:
    return None


async def test_stop_ends_a_pause_at_once_and_the_loop_with_it() -> None:
    fake, stop, never = FakeTime(), asyncio.Event(), asyncio.Event()

    async def endless_sleep(seconds: float) -> None:  # a pause that would outlast the test
        fake.sleeps.append(seconds)
        await never.wait()

    async with _costly_client(fake, [0.1]) as client:
        scraper = Scraper(
            [_target("ok", "http://d0/metrics")],
            client,
            interval_s=60.0,
            timeout_s=1.0,
            max_body_bytes=2**20,
            on_round=_noop,
            jitter_s=0.0,
            clock=fake.clock,
            sleep=endless_sleep,
        )
        task = asyncio.create_task(scraper.run(stop))
        await async_wait_until("the pause after the first round", lambda: fake.sleeps)
        stop.set()
        await asyncio.wait_for(task, timeout=10)  # a guard against a hang, not a bound
    assert scraper.rounds == 1 and fake.sleeps == [pytest.approx(59.9)]


def test_timeout_must_be_below_interval() -> None:
    with pytest.raises(ValueError):
        Scraper([], httpx.AsyncClient(), interval_s=1.0, timeout_s=1.0, max_body_bytes=1, on_round=None)  # type: ignore[arg-type]


async def test_each_round_scrapes_the_targets_assign_names() -> None:
    """Sharded: the round's targets are asked for at the start of each round, and only they are fetched."""
    fake, stop = FakeTime(), asyncio.Event()
    targets = [_target(name, f"http://{name}/metrics") for name in ("a", "b", "c")]
    shares = [targets[:2], targets[2:], []]
    fetched: list[str] = []
    rounds: list[list[str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        fetched.append(request.url.host)
        return httpx.Response(200, content=DECODE)

    async def assign() -> list[ScrapeTarget]:
        return shares[len(rounds)]

    async def on_round(results: list[ScrapeResult]) -> None:
        rounds.append([r.target.name for r in results])
        if len(rounds) == len(shares):
            stop.set()

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        scraper = Scraper(
            targets,
            client,
            interval_s=1.0,
            timeout_s=0.5,
            max_body_bytes=2**20,
            on_round=on_round,
            jitter_s=0.0,
            clock=fake.clock,
            sleep=fake.sleep,
            assign=assign,
        )
        await asyncio.wait_for(scraper.run(stop), timeout=10)  # a guard against a hang, not a bound
    assert rounds == [["a", "b"], ["c"], []]
    assert sorted(fetched) == ["a", "b", "c"]
