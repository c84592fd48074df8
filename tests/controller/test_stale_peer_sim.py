"""A stale peer after a restart, end to end on a simulated fleet: simulator -> proxy -> collector ->
store -> controller -> proxy.

prefill-0 restarts (down, then back: its process start time moves and its counters reset, and the
collector confirms the restart). decode-0 keeps a stale agent for it (the simulator's ``stale_peer``
fault): each of its pulls from prefill-0 fails, and the proxy retries them on decode-1. The
controller leaves the pair out of routing (``StalePeerAfterRestart``) and does not cut decode-0,
which serves prefill-1 well. Once the stale agent is gone, a probe through the pair is served and
the pair comes back. The stored run replays exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from tests.support.closedloop import closed_loop
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.slow

BASE: dict[str, Any] = dict(
    slo={"window_s": 20},
    collector={"scrape_interval_s": 1.0, "scrape_timeout_s": 0.9},
    controller={"interval_s": 1.0, "window_s": 10, "kv_lease_s": 2.0},
)
PROXY = {
    "routing_poll_s": 0.25,
    "pair_probe_s": 2.0,
    "timeouts": {"decode_first_token_s": 4.0, "prefill_s": 5.0},
}


async def test_a_d_with_a_stale_agent_for_a_restarted_p_loses_the_pair_not_its_weight(tmp_path: Path) -> None:
    from simulator.testing import running_fleet
    from store.models import InstanceRow, Snapshot

    # prefill-0 answers 12 s after its new process starts (a vLLM loads first): past the 10 s window
    with running_fleet(n_prefill=2, n_decode=2, seed=3, lease_duration_s=2.0, startup_s=12.0) as fleet:
        async with closed_loop(fleet, tmp_path, "stale", BASE, PROXY) as loop:
            factory, http, ctl_url = loop.factory, loop.http, loop.ctl_url

            async def records() -> bool:
                return (await http.get(f"{ctl_url}/v1/slo")).json()["completed"] >= 10

            await async_wait_until("request records", records, timeout_s=90, every_s=0.5)

            def restarted() -> float | None:
                with factory() as s:
                    row = s.scalars(select(InstanceRow).where(InstanceRow.name == "prefill-0")).one()
                    return row.restarted_at

            assert restarted() is None
            down = fleet.inject({"kind": "down", "instance": "prefill-0"})

            def scraped_down() -> bool:
                with factory() as s:
                    newest = s.scalars(
                        select(Snapshot).where(Snapshot.instance == "prefill-0").order_by(Snapshot.ts.desc())
                    ).first()
                    return newest is not None and not newest.up

            await async_wait_until("the collector to see prefill-0 down", scraped_down, timeout_s=30)
            stale = fleet.inject({"kind": "stale_peer", "prefill": "prefill-0", "decode": "decode-0"})
            fleet.remove_fault(down)  # back: a new process, with decode-0's agent for it stale
            at = await async_wait_until("the restart confirmed", restarted, timeout_s=30)
            assert at is not None

            async def avoided() -> dict[str, Any] | None:
                table = await loop.routing()
                pairs = [(a["prefill"], a["decode"], a["reason"]) for a in table.get("avoid_pairs", [])]
                return table if ("prefill-0", "decode-0", "StalePeerAfterRestart") in pairs else None

            table = await async_wait_until("the stale pair left out", avoided, timeout_s=60, every_s=0.5)
            weights = {i["name"]: i["weight"] for i in table["instances"]}
            assert weights["decode-0"] >= 0.9, weights  # the pair's failures are not decode-0's

            fleet.remove_fault(stale)  # decode-0 handshakes afresh

            async def back() -> bool:
                return not (await loop.routing()).get("avoid_pairs")

            await async_wait_until("a probe served: the pair back", back, timeout_s=60, every_s=0.5)
            decisions = (await http.get(f"{ctl_url}/v1/decisions", params={"subject": "decode-0"})).json()
            cuts = [
                (
                    d["ts"] - at,
                    d["reason"],
                    d["new_value"],
                    {k: v for k, v in d["inputs"].items() if "fail" in k or "basis" in k or "errors" in k},
                )
                for d in decisions
                if d["new_value"] < 0.9
            ]
            assert not cuts, cuts  # its failed pulls and the leases they left were the pair's
            replayed = (await http.get(f"{ctl_url}/v1/replay", params={"since": "1h"})).json()
            assert replayed["reproduced"] is True, replayed["mismatches"][:3]
