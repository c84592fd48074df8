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
import math
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


async def _cuts(loop: ClosedLoop, name: str, since: float) -> list[tuple[str, str, Any, float, Any]]:
    """The cuts of ``name``'s weight decided since ``since``: (reason, message, what stale pairs moved,
    seconds after ``since``, the decision's inputs: what a failing run must show)."""
    got = await loop.http.get(
        f"{loop.ctl_url}/v1/decisions", params={"subject": name, "field": "weight", "since": since}
    )
    got.raise_for_status()
    return [
        (x["reason"], x["message"], x["inputs"].get("stale_peer_basis"), x["ts"] - since, x["inputs"])
        for x in got.json()
        if x["old_value"] is not None and x["new_value"] is not None and x["new_value"] < x["old_value"]
    ]


def _print_failures(factory: Any, since: float, at: float) -> None:
    """The failed records since ``since``, per second after the restart was seen (``at``) by when P
    finished them, at P and at D: a run that charges D shows whether the pair failed enough, and was
    stored in time, to be called stale."""
    from store.models import RequestRecord

    with factory() as s:
        rows = s.execute(
            select(RequestRecord.p_done, RequestRecord.d_sent)
            .where(RequestRecord.proxy_in > since, RequestRecord.status != "ok")
            .order_by(RequestRecord.proxy_in)
        ).all()
    per_s: dict[tuple[int, str], int] = {}
    for p_done, d_sent in rows:
        key = (math.floor(p_done - at) if p_done is not None else -999, "P" if d_sent is None else "D")
        per_s[key] = per_s.get(key, 0) + 1
    print("failed records by second after the restart was seen, at P / at D:", sorted(per_s.items()))


async def _print_decisions(loop: ClosedLoop, names: list[str], since: float) -> None:
    """Every weight decision of ``names`` since ``since`` (seconds after it), with its failure inputs."""
    for name in names:
        got = await loop.http.get(
            f"{loop.ctl_url}/v1/decisions", params={"subject": name, "field": "weight", "since": since - 30}
        )
        for x in got.json():
            i = x["inputs"]
            print(
                f"decision {x['ts'] - since:7.2f} {name} {x['old_value']}->{x['new_value']} {x['reason']} "
                f"ftpm={i.get('failed_transfers_per_min')} fr={i.get('failed_requests')} "
                f"basis={i.get('stale_peer_basis')} up={i.get('up')}"
            )


def _print_snapshots(factory: Any, since: float) -> None:
    """Each instance's scrapes since ``since`` where up or D's failed NIXL transfers changed."""
    from store.models import Snapshot

    with factory() as s:
        rows = s.execute(
            select(Snapshot.ts, Snapshot.instance, Snapshot.up, Snapshot.nixl_failed_transfers)
            .where(Snapshot.ts > since - 5)
            .order_by(Snapshot.ts)
        ).all()
    last: dict[str, Any] = {}
    for ts, name, up, failed in rows:
        if last.get(name) != (up, failed):
            print(f"snapshot {ts - since:7.2f} {name} up={up} nixl_failed={failed}")
        last[name] = (up, failed)


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
        print(f"restart seen {at - before:.1f} s after it began, the pair out {time.time() - at:.1f} s after")
        _print_failures(factory, since=before, at=at)
        await _print_decisions(loop, [p, d], since=before)
        _print_snapshots(factory, since=before)
        # the pair's failures are not D's: no cut of D's weight since P's restart charges it failures (a cut
        # for its latency on this loaded machine is D's own, and no business of this test)
        cuts = await _cuts(loop, d, since=before)
        assert not [c for c in cuts if c[0] in FAILURE_REASONS], (at - before, cuts)
        assert served_since(at) == 0  # every handoff through the stale agent failed

        await asyncio.to_thread(pair.restart, pair.decode, STARTUP_TIMEOUT_S)  # a fresh agent

        async def back() -> bool:
            return not (await loop.routing()).get("avoid_pairs")

        await async_wait_until(
            "a handoff served: the pair back", back, timeout_s=90, every_s=0.5, ignore=slow
        )
        assert served_since(at) > 0
