"""A P restart mid-load on a real CPU vLLM pair, through the whole loop: proxy -> collector -> store ->
controller -> proxy.

Its own pair (module scope), P with a fixed NIXL engine id (``kv_transfer_config.engine_id``), as
deployments that pin it have. On vLLM 0.32.0 (CPU, NIXL 1.5.1) that is what leaves D with a stale
agent: after P restarts, every pull of D's from the new P fails (HTTP 500), while with an engine id
drawn afresh at each start (vLLM's default) D handshakes the new P and the first handoff is served.

With traffic flowing through the proxy, P restarts. The collector must confirm the restart from P's
own signals (its process start time moved *and* its counters reset), the controller must leave the
pair out of routing as ``StalePeerAfterRestart`` without charging D the failures (they are the
pair's), and the pair must stay out until a handoff through it is served again: here after D
restarts too (a fresh agent), the operator's fix. With one D the proxy still sends the pair work
(a pick never leaves out every D), so the pair's first served handoff is what brings it back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from pdscope.reasons import Reason
from tests.real_vllm.conftest import STARTUP_TIMEOUT_S, own_pair
from tests.real_vllm.pair import MODEL_NAME, RealPair
from tests.support.closedloop import ClosedLoop, closed_loop
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.real_vllm

ENGINE_ID = "pdscope-real-restart-p0"
BASE: dict[str, Any] = dict(
    slo={"window_s": 30},
    collector={"scrape_interval_s": 1.0, "scrape_timeout_s": 0.9},
    controller={"interval_s": 1.0, "window_s": 15},
)
PROXY = {
    "routing_poll_s": 0.25,
    "pair_probe_s": 1.0,
    "timeouts": {"connect_s": 5, "prefill_s": 30, "decode_first_token_s": 30, "decode_total_s": 60},
}
TRAFFIC = {"workers": 2, "max_tokens": 4, "model": MODEL_NAME, "words": 40}
FAILURE_REASONS = {
    Reason.TRANSFER_FAILURES,
    Reason.REQUEST_FAILURES,
    Reason.LEASE_EXPIRIES,
    Reason.UNATTRIBUTED_LEASE_EXPIRIES,
}


async def _cuts(loop: ClosedLoop, name: str, since: float) -> list[tuple[str, str, Any]]:
    """The cuts of ``name``'s weight decided since ``since``: (reason, message, what stale pairs moved)."""
    got = await loop.http.get(
        f"{loop.ctl_url}/v1/decisions", params={"subject": name, "field": "weight", "since": since}
    )
    got.raise_for_status()
    return [
        (x["reason"], x["message"], x["inputs"].get("stale_peer_basis"))
        for x in got.json()
        if x["old_value"] is not None and x["new_value"] is not None and x["new_value"] < x["old_value"]
    ]


@pytest.fixture(scope="module")
def fixed_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealPair]:
    pair = own_pair(tmp_path_factory, "restart", engine_id=ENGINE_ID)
    try:
        yield pair
    finally:
        pair.stop()


async def test_a_p_restart_mid_load_is_seen_and_its_stale_pair_kept_out_until_served(
    fixed_pair: RealPair, tmp_path: Path
) -> None:
    from store.models import InstanceRow, RequestRecord

    pair = fixed_pair
    p, d = pair.prefill.name, pair.decode.name
    async with closed_loop(pair, tmp_path, "restart", BASE, PROXY, traffic_kw=TRAFFIC) as loop:
        factory = loop.factory

        def served_since(t: float) -> int:
            with factory() as s:
                q = select(func.count()).select_from(RequestRecord)
                return int(s.scalar(q.where(RequestRecord.status == "ok", RequestRecord.proxy_in > t)) or 0)

        def restarted() -> float | None:
            with factory() as s:
                return s.scalars(select(InstanceRow.restarted_at).where(InstanceRow.name == p)).one()

        # P's counters must be well ahead of what its new process can serve before the collector's first
        # scrape of it: the restart is confirmed by process start *and* a counter going down, and a P
        # restarted after 7 requests had served 9 by that scrape (a CI run of stop 45: not confirmed)
        await async_wait_until("records of served requests", lambda: served_since(0) >= 40, timeout_s=180)
        assert restarted() is None
        before = time.time()
        await asyncio.to_thread(pair.restart, pair.prefill, STARTUP_TIMEOUT_S)
        at = await async_wait_until("the collector to confirm P's restart", restarted, timeout_s=60)
        assert at is not None

        async def avoided() -> dict[str, Any] | None:
            table = await loop.routing()
            pairs = [(a["prefill"], a["decode"], a["reason"]) for a in table.get("avoid_pairs", [])]
            return table if (p, d, "StalePeerAfterRestart") in pairs else None

        # a busy 2-core machine (the pair, the loop's services, the traffic) can answer a poll late
        slow = (httpx.HTTPError,)
        await async_wait_until("the stale pair left out", avoided, timeout_s=90, every_s=0.5, ignore=slow)
        # the pair's failures are not D's: no cut of D's weight since P's restart charges it failures (a cut
        # for its latency on this loaded machine is D's own, and no business of this test)
        cuts = await _cuts(loop, d, since=before)
        assert not [c for c in cuts if c[0] in FAILURE_REASONS], cuts
        assert served_since(at) == 0  # every handoff through the stale agent failed

        await asyncio.to_thread(pair.restart, pair.decode, STARTUP_TIMEOUT_S)  # a fresh agent

        async def back() -> bool:
            return not (await loop.routing()).get("avoid_pairs")

        await async_wait_until(
            "a handoff served: the pair back", back, timeout_s=90, every_s=0.5, ignore=slow
        )
        assert served_since(at) > 0
