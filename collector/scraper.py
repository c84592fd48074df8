"""Scrape every target's ``/metrics`` concurrently, on an interval, with hard limits.

One shared ``httpx.AsyncClient`` serves every target. Each scrape runs under its own
deadline (``scrape_timeout_s``, shorter than the interval) that covers connecting, the
headers *and* the body, read as a stream: a target that answers one byte a second is cut
at the deadline, and a body past ``max_body_bytes`` is cut as soon as it crosses the cap.
All targets of a round start together (each after a small random jitter, so a thousand
scrapes do not land in the same millisecond), so one slow or dead target never delays
another. A scrape never raises: the outcome is a ``ScrapeResult`` with either the page's
signals or an error string.

The loop in ``Scraper.run`` hands each round's results to a callback (the store writer
and the self-metrics); it must not block the event loop, so storing runs in a thread.
A round that raises anyway is logged (rate-limited), counted in ``round_errors`` and the
loop goes on; ``on_tick`` is called every turn (the liveness heartbeat). ``assign``, when
given, is awaited at the start of every round and names that round's targets (this
collector's share, ``collector.membership``); it must not raise. Logging stays
quiet at INFO: a line when the set of down targets changes, each round at DEBUG. The
cadence's clock and sleep are injected (the event loop's by default), so a test drives time.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from collector.fastparse import extract_signals
from collector.health import RateLimitedLog
from collector.signals import Signals
from collector.targets import ScrapeTarget
from store.models import UNREACHABLE

log = logging.getLogger(__name__)

ACCEPT = "text/plain;version=0.0.4;q=1,*/*;q=0.1"


class BodyTooLarge(Exception):
    pass


class PerOriginTransport(httpx.AsyncBaseTransport):
    """One small connection pool per target origin, behind the one shared client.

    httpcore's pool scans every pooled connection for each request, so one pool holding
    a keep-alive connection to each of a thousand targets costs O(targets) per request,
    O(targets²) per round. Keyed by origin, each pool holds the one or two connections
    of its target and the lookup is a dict hit.
    """

    def __init__(self, per_origin: int = 2) -> None:
        self._limits = httpx.Limits(max_connections=per_origin, max_keepalive_connections=per_origin)
        self._pools: dict[tuple[bytes, bytes, int | None], httpx.AsyncHTTPTransport] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        key = (url.raw_scheme, url.raw_host, url.port)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = httpx.AsyncHTTPTransport(limits=self._limits)
        return await pool.handle_async_request(request)

    async def aclose(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await pool.aclose()


@dataclass(frozen=True)
class ScrapeResult:
    target: ScrapeTarget
    ts: float  # wall clock when the scrape started
    duration_s: float
    signals: Signals | None
    error: str | None
    body_bytes: int = 0

    @property
    def up(self) -> bool:
        return self.signals is not None


async def _read_capped(response: httpx.Response, cap: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > cap:
            raise BodyTooLarge(f"body larger than {cap} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def scrape_one(
    client: httpx.AsyncClient,
    target: ScrapeTarget,
    timeout_s: float,
    max_body_bytes: int,
    clock: Callable[[], float] = time.time,
) -> ScrapeResult:
    """Fetch and parse one page within ``timeout_s`` (everything included). Never raises."""
    ts = clock()
    start = time.perf_counter()
    body = b""
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("GET", target.metrics_url, headers={"Accept": ACCEPT}) as response:
                if response.status_code != 200:
                    raise httpx.HTTPStatusError(
                        f"HTTP {response.status_code}", request=response.request, response=response
                    )
                body = await _read_capped(response, max_body_bytes)
    except TimeoutError:
        error = f"timeout after {timeout_s:g}s"
    except BodyTooLarge as exc:
        error = str(exc)
    except httpx.HTTPStatusError as exc:
        error = str(exc)
    except httpx.ConnectError as exc:  # refused or no route: nothing listens (a timeout is another branch)
        error = f"{UNREACHABLE}{type(exc).__name__}: {exc}"
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    else:
        signals = extract_signals(body)
        duration = time.perf_counter() - start
        if not signals.values and not signals.histograms:
            detail = f": {signals.errors[0]}" if signals.errors else ""
            return ScrapeResult(target, ts, duration, None, f"no vLLM metrics on the page{detail}", len(body))
        return ScrapeResult(target, ts, duration, signals, None, len(body))
    duration = time.perf_counter() - start
    return ScrapeResult(target, ts, duration, None, error[:500], len(body))


class Scraper:
    """Scrapes all targets every ``interval_s``; ``on_round`` receives each round's results."""

    def __init__(
        self,
        targets: Sequence[ScrapeTarget],
        client: httpx.AsyncClient,
        *,
        interval_s: float,
        timeout_s: float,
        max_body_bytes: int,
        on_round: Callable[[list[ScrapeResult]], Coroutine[Any, Any, None]],
        jitter_s: float | None = None,
        rng: random.Random | None = None,
        on_tick: Callable[[], None] | None = None,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        assign: Callable[[], Awaitable[Sequence[ScrapeTarget]]] | None = None,
    ) -> None:
        """``clock`` (monotonic seconds; default the running loop's ``time()``) and ``sleep``
        pace the rounds and the jitter; ``stop`` interrupts a pause between rounds. ``assign``
        picks each round's targets (default: every one of ``targets``)."""
        if timeout_s >= interval_s:
            raise ValueError("scrape timeout must be shorter than the interval")
        self.targets = list(targets)
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_body_bytes = max_body_bytes
        self.on_round = on_round
        # Jitter spreads a round's starts; it is taken from the slack the timeout leaves.
        self.jitter_s = min(0.1 * interval_s, interval_s - timeout_s) if jitter_s is None else jitter_s
        self.rng = rng or random.Random()
        self.rounds = 0
        self.round_errors = 0
        self.on_tick = on_tick
        self.assign = assign
        self._clock = clock
        self._sleep = sleep
        self._down: frozenset[str] = frozenset()
        self._warn = RateLimitedLog(log)

    async def _jittered(self, target: ScrapeTarget) -> ScrapeResult:
        if self.jitter_s > 0:
            await self._sleep(self.rng.uniform(0, self.jitter_s))
        return await scrape_one(self.client, target, self.timeout_s, self.max_body_bytes)

    async def scrape_round(self) -> list[ScrapeResult]:
        return list(await asyncio.gather(*(self._jittered(t) for t in self.targets)))

    async def run(self, stop: asyncio.Event) -> None:
        """Scrape on a fixed cadence until ``stop`` is set; a slow store never skews it."""
        now = self._clock or asyncio.get_running_loop().time
        next_at = now()
        pending: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            if self.on_tick is not None:
                self.on_tick()
            try:
                if self.assign is not None:
                    self.targets = list(await self.assign())
                results = await self.scrape_round()
            except Exception as exc:  # scrape_one never raises; a bug here must not end scraping
                self.round_errors += 1
                self._warn.warning("round", "scrape round failed: %r", exc, exc_info=exc)
                results = None
            if results is not None:
                self.rounds += 1
                self._log_round(results)
                task = asyncio.create_task(self.on_round(results))
                pending.add(task)
                task.add_done_callback(pending.discard)
            next_at += self.interval_s
            delay = next_at - now()
            if delay < 0:  # fell behind (a huge fleet): skip the missed slots
                next_at = now()
                delay = 0
            await self._pause(delay, stop)
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    async def _pause(self, delay: float, stop: asyncio.Event) -> None:
        """Sleep ``delay`` seconds, or less if ``stop`` is set meanwhile."""
        if stop.is_set():
            return
        sleeping = asyncio.ensure_future(self._sleep(delay))
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait((sleeping, stopping), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in (sleeping, stopping):
                waiter.cancel()
            await asyncio.gather(sleeping, stopping, return_exceptions=True)

    def _log_round(self, results: Sequence[ScrapeResult]) -> None:
        down = frozenset(r.target.name for r in results if not r.up)
        log.debug("scrape round %d: %d targets, %d down", self.rounds, len(results), len(down))
        if down != self._down:
            went, back = sorted(down - self._down), sorted(self._down - down)
            log.info(
                "scrape: %d of %d targets down (newly down %s, back up %s)",
                len(down),
                len(results),
                went[:10],
                back[:10],
            )
            self._down = down
