"""The collector against the simulated fleet: what it stores matches what was sent."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from collector.scraper import PerOriginTransport, ScrapeResult, scrape_one
from collector.service import CollectorService
from collector.targets import targets_from_settings
from pdscope.config import parse_config
from store.db import make_engine, session_factory
from store.migrate import upgrade
from store.models import Snapshot
from store.queries import instance_signals
from tests.support.waiting import async_wait_until

running_fleet = pytest.importorskip("simulator.testing").running_fleet


async def _two_step(client: httpx.AsyncClient, p_url: str, d_url: str, model: str, i: int) -> None:
    rid = str(uuid.uuid4())
    body = {"model": model, "prompt": f"{rid} request {i} " + "word " * 40, "max_tokens": 6}
    pre = dict(
        body,
        max_tokens=1,
        stream=False,
        kv_transfer_params={
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    )
    r = await client.post(p_url + "/v1/completions", json=pre, headers={"X-Request-Id": rid})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    r = await client.post(
        d_url + "/v1/completions", json=dict(body, kv_transfer_params=params), headers={"X-Request-Id": rid}
    )
    assert r.status_code == 200, r.text


def _count(result: ScrapeResult, col: str) -> float:
    assert result.signals is not None, result.error
    return result.signals.values.get(col, 0.0)


async def test_simulated_fleet_transfers_and_outcomes(tmp_path: Path) -> None:
    with running_fleet(n_prefill=1, n_decode=2, seed=1, latency_scale=0.0) as fleet:
        settings = parse_config(
            fleet.config_yaml(
                store={"url": f"sqlite:///{tmp_path / 'sim.db'}"},
                collector={"scrape_interval_s": 0.5, "scrape_timeout_s": 0.4},
            )
        )
        upgrade(settings.store.url)
        targets = {t.name: t for t in targets_from_settings(settings)}
        async with httpx.AsyncClient(transport=PerOriginTransport(), timeout=10) as scrape_client:
            before = {n: await scrape_one(scrape_client, t, 5.0, 8 * 2**20) for n, t in targets.items()}
            assert all(r.up for r in before.values()), {n: r.error for n, r in before.items()}
            service = CollectorService(settings, port=0)
            stop = asyncio.Event()
            task = asyncio.create_task(service.run(stop))
            n = {"decode-0": 5, "decode-1": 3}
            async with httpx.AsyncClient(timeout=30) as client:
                for d_name, count in n.items():
                    for i in range(count):
                        await _two_step(
                            client, fleet.url_of("prefill-0"), fleet.url_of(d_name), fleet.model_name, i
                        )
            factory = session_factory(make_engine(settings.store.url))

            def stored_transfers() -> dict[str, float | None]:
                with factory() as s:
                    newest = {
                        x.instance: x
                        for x in s.scalars(
                            select(Snapshot).where(Snapshot.up.is_(True)).order_by(Snapshot.ts)
                        )
                    }
                return {d: newest[d].nixl_xfer_time_count if d in newest else None for d in n}

            sent = {d: _count(before[d], "nixl_xfer_time_count") + count for d, count in n.items()}
            # a scrape after the traffic, stored
            await async_wait_until(
                "the collector to store the transfers sent",
                stored_transfers,
                done=lambda stored: stored == sent,
                timeout_s=15,
            )
            stop.set()
            await asyncio.wait_for(task, timeout=15)
            after = {name: await scrape_one(scrape_client, t, 5.0, 8 * 2**20) for name, t in targets.items()}

    def delta(name: str, col: str) -> float:
        a, b = after[name].signals, before[name].signals
        assert a is not None and b is not None
        return a.values.get(col, 0.0) - b.values.get(col, 0.0)

    # what the scraper reads off the simulator is what was sent
    for d_name, count in n.items():
        assert delta(d_name, "nixl_xfer_time_count") == count
    assert delta("prefill-0", "requests_length") + delta("prefill-0", "requests_stop") == sum(n.values())
    # and the collector stored it: the latest snapshot per instance carries the same counters
    with factory() as s:
        latest = {}
        for snap in s.scalars(select(Snapshot).where(Snapshot.up.is_(True)).order_by(Snapshot.ts)):
            latest[snap.instance] = snap
        sig = instance_signals(s, 0.0, 1e12)
    for d_name, count in n.items():
        assert latest[d_name].nixl_xfer_time_count == after[d_name].signals.values["nixl_xfer_time_count"]  # type: ignore[union-attr]
        assert sig[d_name].increases.get("nixl_xfer_time_count", 0.0) <= count
    assert set(latest) == set(targets)
