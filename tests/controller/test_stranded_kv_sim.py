"""StrandedKV on a simulated fleet: simulator -> collector -> store -> observe -> the alert rule.

P prefills three handoffs whose decode legs are never sent (the client left after P). Each leaves
its blocks under a lease that no D will pull. With P's lease reaper stalled (the simulator's
``lease_stall`` fault), the blocks stay held while P runs nothing and no D waits to pull: the rule
holds for P and names its unserved handoffs. With the reaper working, the leases expire and the
rule stays quiet.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from collector.service import CollectorService
from controller.observe import observe
from controller.policy import AlertConfig, PolicyConfig
from controller.policy.alerts import Sample, default_rules
from controller.policy.signals import Observation
from pdscope.config import Settings, parse_config
from store.db import make_engine, session_factory
from store.migrate import upgrade
from store.models import Snapshot
from tests.support.waiting import async_wait_until

running_fleet = pytest.importorskip("simulator.testing").running_fleet
pytestmark = pytest.mark.slow

LEASE_S = 1.0


async def _prefill_only(client: httpx.AsyncClient, p_url: str, model: str) -> str:
    """What a proxy sends P for a handoff; the decode leg never follows."""
    rid = str(uuid.uuid4())
    body = {
        "model": model,
        "prompt": f"{rid} " + "word " * 60,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    r = await client.post(p_url + "/v1/completions", json=body, headers={"X-Request-Id": rid})
    assert r.status_code == 200, r.text
    assert r.json()["kv_transfer_params"]["remote_block_ids"], r.json()
    return rid


def _stranded(settings: Settings, factory: object) -> tuple[Observation, list[Sample]]:
    ac = AlertConfig()
    rule = next(r for r in default_rules(ac) if r.name == "StrandedKV")
    with factory() as s:  # type: ignore[operator]
        obs = observe(s, settings, time.time(), window_s=30.0)
    return obs, rule.evaluate(obs, PolicyConfig.from_settings(settings), ac) or []


def _newest(factory: object, name: str) -> Snapshot | None:
    with factory() as s:  # type: ignore[operator]
        return s.scalars(
            select(Snapshot)
            .where(Snapshot.instance == name, Snapshot.up.is_(True))
            .order_by(Snapshot.ts.desc())
        ).first()


@pytest.mark.parametrize("stalled", [True, False], ids=["reaper-stalled", "reaper-working"])
async def test_an_idle_p_holding_leases_no_d_will_pull_is_stranded_kv(tmp_path: Path, stalled: bool) -> None:
    with running_fleet(n_prefill=1, n_decode=2, seed=1, latency_scale=0.0, lease_duration_s=LEASE_S) as fleet:
        settings = parse_config(
            fleet.config_yaml(
                store={"url": f"sqlite:///{tmp_path / 'sim.db'}"},
                collector={"scrape_interval_s": 0.25, "scrape_timeout_s": 0.2},
            )
        )
        upgrade(settings.store.url)
        factory = session_factory(make_engine(settings.store.url))
        if stalled:
            fleet.inject({"kind": "lease_stall", "instance": "prefill-0"})
        service = CollectorService(settings, port=0)
        stop = asyncio.Event()
        task = asyncio.create_task(service.run(stop))
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                sent = [
                    await _prefill_only(client, fleet.url_of("prefill-0"), fleet.model_name) for _ in range(3)
                ]
            t_sent = time.time()

            def past_the_lease() -> Snapshot | None:
                snap = _newest(factory, "prefill-0")
                return snap if snap is not None and snap.ts > t_sent + 2 * LEASE_S else None

            snap = await async_wait_until(
                "a scrape of P two leases after the handoffs", past_the_lease, timeout_s=30
            )
            assert snap is not None
            obs, samples = _stranded(settings, factory)
        finally:
            stop.set()
            await asyncio.wait_for(task, timeout=15)

    p = obs.instance("prefill-0")
    assert p is not None and p.num_running == 0 and p.num_waiting == 0
    assert all(d.pulls_pending == 0 for d in obs.instances if d.role == "decode"), obs.instances
    if stalled:
        assert snap.kv_cache_usage is not None and snap.kv_cache_usage > 0
        assert [sm.labels["instance"] for sm in samples] == ["prefill-0"]
        assert samples[0].value == pytest.approx(snap.kv_cache_usage, abs=0.05)
    else:
        assert snap.kv_cache_usage == 0.0 and (snap.nixl_kv_expired_reqs or 0) >= len(sent)
        assert samples == []
