"""Compatible pairs only, end to end on a simulated fleet: simulator -> collector -> store -> controller ->
proxy.

decode-1 runs a KV block size of 32 where every other instance runs 16 (the simulator's per-instance
``block_size``, which its ``vllm:cache_config_info`` reports as vLLM does). The collector stores each
instance's identity, the controller leaves both pairs into decode-1 out of routing
(``IncompatiblePair``) and fires ``IncompatiblePair`` for it, and the proxy sends it nothing more while
both Ps keep serving through decode-0. The healthy pairs are never left out.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from tests.support.closedloop import closed_loop
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.slow


async def test_a_d_with_another_block_size_gets_no_traffic_and_is_alerted(tmp_path: Path) -> None:
    from simulator.testing import running_fleet
    from store.models import Alert, RequestRecord

    base: dict[str, Any] = dict(
        slo={"window_s": 20},
        collector={"scrape_interval_s": 0.5, "scrape_timeout_s": 0.4},
        controller={"interval_s": 0.5, "window_s": 10},
        alerts={"rules": {"IncompatiblePair": {"for_s": 0}}},
    )
    # a probe would be due often: none may go through these pairs
    proxy = {"routing_poll_s": 0.25, "pair_probe_s": 0.5}
    with running_fleet(n_prefill=2, n_decode=2, seed=5, instances={"decode-1": {"block_size": 32}}) as fleet:
        async with closed_loop(fleet, tmp_path, "compat", base, proxy) as loop:
            factory = loop.factory

            async def avoided() -> set[tuple[str, str]] | None:
                table = await loop.routing()
                pairs = {
                    (a["prefill"], a["decode"])
                    for a in table.get("avoid_pairs", [])
                    if a["reason"] == "IncompatiblePair"
                }
                return pairs or None

            pairs = await async_wait_until("the pairs into decode-1 left out", avoided, timeout_s=60)
            assert pairs == {("prefill-0", "decode-1"), ("prefill-1", "decode-1")}
            applied = time.time() + 1.0  # the proxy polls every 0.25 s

            def served_after(d: str) -> int:
                with factory() as s:
                    return int(
                        s.scalar(
                            select(func.count())
                            .select_from(RequestRecord)
                            .where(RequestRecord.d_instance == d, RequestRecord.proxy_in > applied)
                        )
                        or 0
                    )

            def by_p() -> bool:
                with factory() as s:
                    rows = s.execute(
                        select(RequestRecord.p_instance, func.count())
                        .where(RequestRecord.proxy_in > applied, RequestRecord.d_instance == "decode-0")
                        .group_by(RequestRecord.p_instance)
                    ).all()
                return len(rows) == 2 and min(n for _, n in rows) >= 5

            await async_wait_until("both Ps served through decode-0", by_p, timeout_s=90, every_s=0.5)
            assert served_after("decode-1") == 0

            def fired() -> list[dict[str, Any]]:
                with factory() as s:
                    rows = s.scalars(select(Alert).where(Alert.rule == "IncompatiblePair")).all()
                    return [dict(a.labels) | {"state": a.state} for a in rows]

            alerts = await async_wait_until("IncompatiblePair", fired, timeout_s=30, every_s=0.5)
            assert {(a["instance"], a["state"]) for a in alerts} == {("decode-1", "firing")}
            assert served_after("decode-1") == 0
