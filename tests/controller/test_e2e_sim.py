"""End to end on a simulated fleet: simulator -> proxy -> collector -> store -> controller -> proxy.

A 2P+3D simulated fleet serves traffic through pdscope's proxy, which follows the
controller's routing table; the collector scrapes the fleet and assembles request
records from the proxy's spans. One D's NIC becomes 10x slower: the controller lowers its
weight within a few ticks. Then a D stops pulling KV: P's leases expire, the
``KVLeaseExpired`` alert fires, and it resolves once the fault is cleared.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.closedloop import closed_loop
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.slow


async def test_degraded_decode_loses_weight_and_lease_alert_fires_then_resolves(tmp_path: Path) -> None:
    from controller.policy import AlertConfig
    from simulator.testing import running_fleet

    base: dict[str, Any] = dict(
        slo={"window_s": 20},
        collector={"scrape_interval_s": 1.0, "scrape_timeout_s": 0.9},
        controller={"interval_s": 1.0, "window_s": 6, "kv_lease_s": 2.0},
    )
    proxy = {"routing_poll_s": 0.25, "timeouts": {"decode_first_token_s": 4.0, "prefill_s": 5.0}}
    alerts = AlertConfig(for_s={"KVLeaseExpired": 0.0})
    with running_fleet(n_prefill=2, n_decode=3, seed=1, lease_duration_s=2.0) as fleet:
        async with closed_loop(fleet, tmp_path, "e2e", base, proxy, alerts) as loop:
            http, ctl_url = loop.http, loop.ctl_url

            async def weights() -> dict[str, float]:
                table = await loop.routing()
                return {i["name"]: i["weight"] for i in table["instances"]}

            # healthy fleet: records flow, every weight stays 1
            async def records() -> bool:
                slo = (await http.get(f"{ctl_url}/v1/slo")).json()
                return slo["completed"] >= 10

            await async_wait_until(
                "request records from the proxy's spans", records, timeout_s=90, every_s=0.5
            )

            async def all_healthy() -> bool:
                return set((await weights()).values()) == {1.0}

            # On a loaded test machine a scrape can time out; the fleet must settle at equal weights.
            await async_wait_until(
                "every weight at 1.0 on the healthy fleet", all_healthy, timeout_s=60, every_s=0.5
            )

            # (a) decode-2's NIC 10x slower: it loses weight
            fid = fleet.inject({"kind": "slow_nic", "decode": "decode-2", "factor": 10})

            async def degraded() -> dict[str, float] | None:
                w = await weights()
                return w if w["decode-2"] <= 0.5 else None

            w = await async_wait_until("decode-2 to lose weight", degraded, timeout_s=60, every_s=0.5)
            assert w["decode-0"] == 1.0 and w["decode-1"] == 1.0, w
            decisions = (await http.get(f"{ctl_url}/v1/decisions", params={"subject": "decode-2"})).json()
            slow = [d for d in decisions if d["reason"] in ("SlowHandoff", "SlowKVTransfer")]
            assert slow and slow[0]["arithmetic"].startswith("target = max("), decisions[:3]
            assert slow[0]["new_value"] < slow[0]["old_value"]
            fleet.remove_fault(fid)

            # (b) decode-1 stops pulling: P's leases expire -> KVLeaseExpired fires, then resolves
            fid = fleet.inject({"kind": "stop_pulling", "decode": "decode-1"})

            async def firing() -> list[dict[str, Any]]:
                alerts = (await http.get(f"{ctl_url}/v1/alerts", params={"state": "firing"})).json()
                return [a for a in alerts if a["rule"] == "KVLeaseExpired"]

            fired = await async_wait_until("KVLeaseExpired to fire", firing, timeout_s=60, every_s=0.5)
            assert fired[0]["labels"]["role"] == "prefill"
            fleet.remove_fault(fid)

            async def resolved() -> list[dict[str, Any]]:
                alerts = (await http.get(f"{ctl_url}/v1/alerts", params={"state": "resolved"})).json()
                return [a for a in alerts if a["rule"] == "KVLeaseExpired"]

            done = await async_wait_until("KVLeaseExpired to resolve", resolved, timeout_s=60, every_s=0.5)
            assert done[0]["resolved_at"] > done[0]["fired_at"]
            metrics = (await http.get(f"{ctl_url}/metrics")).text
            assert "pdscope_controller_ticks_total" in metrics
            health = (await http.get(f"{ctl_url}/healthz")).json()
            assert health["status"] == "ok", health
            # (c) the recorded run replays: the stored config reproduces every stored decision
            # (the slow-NIC cut, the recovery, the lease alert), a gentler step parts from it
            replayed = (await http.get(f"{ctl_url}/v1/replay", params={"since": "1h"})).json()
            assert replayed["reproduced"] is True, replayed["mismatches"][:3]
            assert replayed["ticks"] > 10 and replayed["decisions"], replayed["decisions"]
            assert any(k.startswith("KVLeaseExpired{") for k in replayed["alerts"]), replayed["alerts"]
            gentle = (
                await http.get(f"{ctl_url}/v1/replay", params={"since": "1h", "set": "max_weight_step=0.05"})
            ).json()
            assert gentle["first_divergence"]["subject"] == "decode-2", gentle["first_divergence"]
