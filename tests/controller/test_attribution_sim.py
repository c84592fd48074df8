"""Attribution against injected faults on a simulated fleet: simulator -> proxy -> collector -> store.

A 2P+2D simulated fleet serves closed-loop traffic (:func:`tests.support.traffic.traffic`, every
prompt its own) through pdscope's proxy (its configured weights: no controller and no admission by
prediction, so nothing moves traffic away from the fault); the collector assembles request records
from the proxy's and the simulated vLLM's spans and runs its forensics (NIXL figures, failed
attempts, lease expiries). The TTFT target is set from the healthy phase (three times its
slowest TTFT). Then one fault of the simulator is injected, one scenario per fault kind, and the
attribution of the records since then must name, as its top reason, the stage and the instance
or pair that was broken:

    slow              a slow P                     prefill (or P's queue) on that P
    slow_link         one slow P x D link          the handoff of that pair
    slow_nic          every link into one D        the handoff on every link into that D (``*->D``)
    slow_nic (a P)    every link out of one P      the handoff on every link out of that P (``P->*``)
    transfer_failure  every read of one pair fails the handoff (or failed attempts) of that pair,
                                                   failed KV transfers
    stop_pulling      a D stops pulling            the handoff (or failed attempts) on every link
                                                   into that D, expired KV leases
    down              a D is gone                  the same, failed requests (``failed:<error>``)
    kv_capacity       a D holds one request only   D queue on that D (12 clients, 64-token answers:
                                                   a queue to see)
    kv_capacity       a D holds no request         the handoff on every link into that D (expired
                                                   KV leases or client disconnects, as when it
                                                   stops pulling)

For ``transfer_failure`` and ``down`` the proxy neither retries nor ejects (:data:`STAY`). The
attribution asserted on is that of the fault's whole span, taken once the collector's forensics has
passed over it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from analysis.attribution import Attribution, MissGroup
from controller.attribution import window_attribution
from pdscope.config import LatencySLO, Settings, parse_config
from store.db import make_engine, session_factory, transaction
from store.migrate import upgrade
from store.models import RequestRecord
from tests.support.collector import CollectorThread
from tests.support.serving import serve
from tests.support.sockets import bound_socket, url_of
from tests.support.traffic import traffic
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.slow
log = logging.getLogger(__name__)

LEASE_S = 2.0  # a short KV lease, so a D that stops pulling lets P's leases expire within the phase


# The proxy neither retries nor routes around a failing instance: with its retries and outlier
# ejection a failed transfer or a D that is gone costs a few milliseconds and no request misses.
STAY: dict[str, Any] = {"retry_budget": 0.0, "outlier": {"max_ejected_share": 0.0, "failure_penalty": 0.0}}


@dataclass(frozen=True)
class Scenario:
    """One fault and what the top reason of the attribution since it must say."""

    fault: dict[str, Any]
    place: str  # the top reason's place: an instance, a pair "P->D", "*->D" (into D) or "P->*" (out of P)
    stages: tuple[str, ...]  # one of these stages
    causes: tuple[str, ...] = ("",)  # its cause starts with one of these
    min_share: float = 0.5
    proxy: dict[str, Any] = field(default_factory=dict)  # the proxy's settings over the defaults below
    workers: int = 4  # closed-loop clients
    max_tokens: int = 6  # of each request

    def matches(self, g: MissGroup) -> bool:
        return g.place == self.place and g.stage in self.stages and g.cause.startswith(self.causes)


SCENARIOS: dict[str, Scenario] = {
    "slow": Scenario(
        {"kind": "slow", "instance": "prefill-1", "factor": 120}, "prefill-1", ("prefill", "p_queue")
    ),
    "slow_link": Scenario(
        {"kind": "slow_link", "prefill": "prefill-0", "decode": "decode-1", "factor": 400},
        "prefill-0->decode-1",
        ("handoff",),
    ),
    "slow_nic": Scenario(
        {"kind": "slow_nic", "decode": "decode-1", "factor": 400}, "*->decode-1", ("handoff",)
    ),
    "slow_nic_p": Scenario(  # a P's NIC, slow toward every D: its row (issue 29)
        {"kind": "slow_nic", "prefill": "prefill-1", "factor": 400}, "prefill-1->*", ("handoff",)
    ),
    "transfer_failure": Scenario(
        {"kind": "transfer_failure", "prefill": "prefill-0", "decode": "decode-1", "rate": 1.0},
        "prefill-0->decode-1",
        ("handoff", "retry"),
        ("transfer_failed",),
        proxy=STAY,
    ),
    "stop_pulling": Scenario(
        {"kind": "stop_pulling", "decode": "decode-1"},
        "*->decode-1",
        ("handoff", "retry"),
        ("lease_expired",),
    ),
    "down": Scenario(
        {"kind": "down", "instance": "decode-1"},
        "*->decode-1",
        ("handoff", "retry"),
        ("failed:",),
        proxy=STAY,
    ),
    "kv_capacity": Scenario(
        {"kind": "kv_capacity", "instance": "decode-1", "blocks": 56},
        "decode-1",
        ("d_queue",),
        max_tokens=64,  # a D that holds one request at a time queues when each holds it a while
        workers=12,
        # the proxy's AIMD limit would turn the queue into 429s at once (counted, with no excess)
        proxy={"adaptive_limit": {"enabled": False}},
    ),
}
# Not checked here: a D whose KV cache holds less than one request. Its handoffs fail after the
# client's timeout and the attribution put them on "every link into decode-1" (handoff, failed) with
# 64 % of the excess in the runs seen, but the share depends on the timeout and the machine's load
# (one CI run on a loaded machine missed it), and from the records alone it reads like stop_pulling.


@dataclass
class Harness:
    """A running fleet behind the proxy, with traffic on it and the SLO set from its healthy phase."""

    fleet: Any
    factory: Any
    settings: Settings  # with the TTFT target from the healthy phase
    attribution: Callable[[float, float], Attribution]

    async def misses_at(self, lo: float, want: Callable[[MissGroup], bool], n: int = 12) -> Attribution:
        """The attribution since ``lo`` once ``n`` misses are in groups ``want`` picks (deadline: 90 s).
        At 8, a D's slow NIC once showed 6 misses through one P and 2 through the other by the end of
        the phase, and the pair out-weighed the column (one CI run of three): 12 steady the shares."""

        async def enough() -> Attribution | None:
            a = await asyncio.to_thread(self.attribution, lo, time.time())
            log.info("%d misses: %s", a.missed, [g.message for g in a.top])
            return a if sum(g.count for g in a.groups if want(g)) >= n else None

        return await async_wait_until("misses where the fault is", enough, timeout_s=90, every_s=1.0)

    async def forensics_after(self, t: float) -> None:
        """Wait until a request that began after ``t`` has its NIXL join: the collector's forensics has
        passed over every request before it (their failed attempts, lease expiries, NIXL figures)."""

        def joined() -> bool:
            with transaction(self.factory) as s:
                rows = s.scalars(select(RequestRecord.attributes).where(RequestRecord.proxy_in > t))
                return any("nixl" in (a or {}) for a in rows)

        await async_wait_until(
            "the forensics of the fault's requests",
            lambda: asyncio.to_thread(joined),
            timeout_s=60,
            every_s=0.5,
        )


@asynccontextmanager
async def simulated(tmp_path: Path, sc: Scenario) -> AsyncIterator[Harness]:
    from proxy.app import build as build_proxy
    from simulator.testing import running_fleet

    url = f"sqlite:///{tmp_path / 'attr.db'}"
    upgrade(url)
    proxy_sock, nobody = bound_socket(), bound_socket()  # nobody: a controller address no one serves
    proxy_url = url_of(proxy_sock)
    with running_fleet(n_prefill=2, n_decode=2, seed=3, lease_duration_s=LEASE_S) as fleet:
        base = dict(
            store={"url": url},
            collector={"scrape_interval_s": 1.0, "scrape_timeout_s": 0.9},
            controller={"kv_lease_s": LEASE_S},
        )
        settings: Settings = parse_config(fleet.config_yaml(**base), "attr.yaml")
        collector = CollectorThread(settings)
        proxy_settings = parse_config(
            fleet.config_yaml(
                **base,
                proxy={
                    "controller_url": url_of(nobody),
                    "otlp_endpoint": f"http://127.0.0.1:{collector.port}",
                    "timeouts": {"decode_first_token_s": 20.0, "prefill_s": 20.0},
                    # admission by prediction would route around the fault this test must see
                    "predict": {"admit": False},
                    **sc.proxy,
                },
            ),
            "attr-proxy.yaml",
        )
        engine = make_engine(url)
        factory = session_factory(engine)
        stop = asyncio.Event()
        collector.__enter__()
        load: asyncio.Task[dict[str, int]] | None = None

        def attribution(lo: float, hi: float, s: Settings) -> Attribution:
            return window_attribution(factory, s, lo, hi).attribution

        try:
            async with serve(build_proxy(proxy_settings), sock=proxy_sock, stop_timeout_s=15):
                load = asyncio.create_task(
                    traffic(proxy_url, stop, workers=sc.workers, max_tokens=sc.max_tokens)
                )
                t_healthy = time.time()

                async def healthy() -> Attribution | None:
                    """30 requests with no miss; a miss (a stall of a loaded CI machine: the simulator
                    logs its event-loop lag) starts the healthy phase again, since the target is set
                    from it."""
                    nonlocal t_healthy
                    a = await asyncio.to_thread(attribution, t_healthy, time.time(), settings)
                    if a.missed:
                        log.info(
                            "a miss in the healthy phase, starting it again: %s", [g.message for g in a.top]
                        )
                        t_healthy = time.time()
                        return None
                    return a if a.requests >= 30 else None

                h = await async_wait_until("healthy records", healthy, timeout_s=90, every_s=0.5)
                ttfts = await asyncio.to_thread(_ttfts, factory, t_healthy)
                log.info(
                    "healthy: %d requests, slowest TTFT %.3f s, stage medians %s",
                    h.requests,
                    max(ttfts),
                    h.baselines,
                )
                assert h.missed == 0 and max(h.baselines.get(k, 0.0) for k in ("p_total", "handoff")) > 0, h
                target_ms = 3000.0 * max(ttfts)
                s = settings.model_copy(
                    update={"slo": settings.slo.model_copy(update={"ttft": LatencySLO(target_ms=target_ms)})}
                )
                yield Harness(fleet, factory, s, lambda lo, hi: attribution(lo, hi, s))
        finally:
            stop.set()
            if load is not None:
                log.info("traffic outcomes: %s", await asyncio.wait_for(load, timeout=30))
            await asyncio.to_thread(collector.__exit__)
            engine.dispose()


@pytest.mark.parametrize("kind", list(SCENARIOS))
async def test_attribution_names_the_broken_stage_and_place(kind: str, tmp_path: Path) -> None:
    sc = SCENARIOS[kind]
    async with simulated(tmp_path, sc) as h:
        t_fault = time.time()
        fid = h.fleet.inject(sc.fault)
        await h.misses_at(t_fault, lambda g: g.place == sc.place)
        t_end = time.time()
        h.fleet.remove_fault(fid)
        await h.forensics_after(t_end)
        a = await asyncio.to_thread(h.attribution, t_fault, t_end)
        log.info("%s: %s", kind, [g.message for g in a.groups])  # all of them: what lost, and by how much
        top = a.top[0]
        assert sc.matches(top), a.top
        assert top.share > sc.min_share, a.top


def _ttfts(factory: object, since: float) -> list[float]:
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
