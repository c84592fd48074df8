"""Attribution against injected faults on a simulated fleet: simulator -> proxy -> collector -> store.

A 2P+2D simulated fleet serves traffic through pdscope's proxy (its configured weights: no
controller, so nothing moves traffic away from the fault); the collector assembles request
records from the proxy's and the simulated vLLM's spans. The TTFT target is set from the healthy
phase (three times its slowest TTFT). Then one P becomes slow: the attribution of that phase names
prefill (or P's queue) on that P. Then one P x D link becomes slow: it names the handoff of that pair.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from controller.attribution import window_attribution
from controller.policy.attribution import Attribution
from pdscope.config import LatencySLO, Settings, parse_config
from store.db import make_engine, session_factory
from store.migrate import upgrade
from tests.support.collector import CollectorThread
from tests.support.serving import serve
from tests.support.sockets import bound_socket, url_of
from tests.support.traffic import traffic
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.slow
log = logging.getLogger(__name__)


async def test_attribution_names_the_broken_stage_and_place(tmp_path: Path) -> None:
    from proxy.app import build as build_proxy
    from simulator.testing import running_fleet

    url = f"sqlite:///{tmp_path / 'attr.db'}"
    upgrade(url)
    proxy_sock, nobody = bound_socket(), bound_socket()  # nobody: a controller address no one serves
    proxy_url = url_of(proxy_sock)
    with running_fleet(n_prefill=2, n_decode=2, seed=3) as fleet:
        base = dict(store={"url": url}, collector={"scrape_interval_s": 1.0, "scrape_timeout_s": 0.9})
        settings: Settings = parse_config(fleet.config_yaml(**base), "attr.yaml")
        collector = CollectorThread(settings)
        proxy_settings = parse_config(
            fleet.config_yaml(
                **base,
                proxy={
                    "controller_url": url_of(nobody),
                    "otlp_endpoint": f"http://127.0.0.1:{collector.port}",
                    "timeouts": {"decode_first_token_s": 20.0, "prefill_s": 20.0},
                },
            ),
            "attr-proxy.yaml",
        )
        factory = session_factory(make_engine(url))
        stop = asyncio.Event()
        collector.__enter__()
        load: asyncio.Task[dict[str, int]] | None = None

        def attribution(lo: float, hi: float, s: Settings) -> Attribution:
            return window_attribution(factory, s, lo, hi).attribution

        async def phase(lo: float, s: Settings, place: str) -> Attribution:
            async def enough() -> Attribution | None:
                a = await asyncio.to_thread(attribution, lo, time.time(), s)
                log.info("%s: %s", place, [g.message for g in a.top])
                return a if sum(g.count for g in a.groups if g.place == place) >= 8 else None

            return await async_wait_until(f"misses at {place}", enough, timeout_s=90, every_s=1.0)

        try:
            async with serve(build_proxy(proxy_settings), sock=proxy_sock, stop_timeout_s=15):
                load = asyncio.create_task(traffic(proxy_url, stop, workers=4))
                t_healthy = time.time()

                async def healthy() -> Attribution | None:
                    a = await asyncio.to_thread(attribution, t_healthy, time.time(), settings)
                    return a if a.requests >= 40 else None

                h = await async_wait_until("healthy records", healthy, timeout_s=90, every_s=0.5)
                ttft_max = max(h.baselines.get(k, 0.0) for k in ("admission", "p_total", "handoff"))
                ttfts = await asyncio.to_thread(_ttfts, factory, t_healthy)
                target_ms = 3000.0 * max(ttfts)
                log.info(
                    "healthy: %d requests, slowest TTFT %.3f s, stage medians %s",
                    h.requests,
                    max(ttfts),
                    h.baselines,
                )
                assert ttft_max > 0
                s = settings.model_copy(
                    update={"slo": settings.slo.model_copy(update={"ttft": LatencySLO(target_ms=target_ms)})}
                )

                # (a) a slow P: prefill (or its queue) on that P
                t_a = time.time()
                fid = fleet.inject({"kind": "slow", "instance": "prefill-1", "factor": 200})
                a = await phase(t_a, s, "prefill-1")
                fleet.remove_fault(fid)
                log.info("slow P: %s", [g.message for g in a.top])
                top = a.top[0]
                assert top.place == "prefill-1" and top.stage in ("prefill", "p_queue"), a.top
                assert top.share > 0.5, a.top

                # (b) a slow link: the handoff of that pair
                await asyncio.sleep(0)  # let the last slow requests finish before the next phase's range
                t_b = await _quiet_after(factory, s, time.time())
                fid = fleet.inject(
                    {"kind": "slow_link", "prefill": "prefill-0", "decode": "decode-1", "factor": 150}
                )
                b = await phase(t_b, s, "prefill-0->decode-1")
                fleet.remove_fault(fid)
                log.info("slow link: %s", [g.message for g in b.top])
                top = b.top[0]
                assert (top.stage, top.place) == ("handoff", "prefill-0->decode-1"), b.top
                assert top.share > 0.5, b.top
        finally:
            stop.set()
            if load is not None:
                log.info("traffic outcomes: %s", await asyncio.wait_for(load, timeout=30))
            await asyncio.to_thread(collector.__exit__)


def _ttfts(factory: object, since: float) -> list[float]:
    from sqlalchemy import select

    from store.db import transaction
    from store.models import RequestRecord

    with transaction(factory) as s:  # type: ignore[arg-type]
        return [
            t
            for t in s.scalars(
                select(RequestRecord.ttft_s).where(
                    RequestRecord.proxy_in >= since, RequestRecord.status == "ok"
                )
            )
            if t is not None
        ]


async def _quiet_after(factory: object, s: Settings, start: float) -> float:
    """The time from which the records of the fleet, the slow P healed, miss no more at prefill-1."""

    async def healed() -> float | None:
        a = await asyncio.to_thread(window_attribution, factory, s, start, time.time())  # type: ignore[arg-type]
        recent = [g for g in a.attribution.groups if g.place == "prefill-1" and g.last > start + 2]
        return time.time() if a.attribution.requests >= 16 and not recent else None

    return await async_wait_until("the slow P to heal", healed, timeout_s=60, every_s=1.0)
