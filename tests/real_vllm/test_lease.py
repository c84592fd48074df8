"""A real fault: a prefill whose decode never comes, then a decode that comes too late.

The pair runs with a short ``kv_lease_duration`` (conftest ``LEASE_S``). P pins the blocks of a
finished prefill for that long; when no D pulls them, P releases them, counts
``vllm:nixl_num_kv_expired_reqs_total`` and logs a warning. A D that asks for them afterwards
still reads P's (now free, not yet reused) blocks: vLLM 0.32.0 answers 200 and counts no failed
transfer. P only hears of it on its next engine step (an idle P takes none): then it logs an
error naming the request and counts ``vllm:nixl_num_notifications_after_expiry_total``.
That late-read signature is what pdscope's lease-expiry detection looks for.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.real_vllm import pd_client as pc
from tests.real_vllm.conftest import RealPD
from tests.real_vllm.pair import tail
from tests.real_vllm.prompts import unique_prompt
from tests.support.waiting import wait_until

pytestmark = pytest.mark.real_vllm

EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"
LATE = "vllm:nixl_num_notifications_after_expiry_total"


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60.0) as c:
        yield c


def test_unclaimed_prefill_expires_and_late_decode_is_flagged(real_pd: RealPD, client: httpx.Client) -> None:
    p_log = real_pd.logs_dir / f"{real_pd.prefill_name}.log"
    # An earlier test may have left a prefill nobody decoded (a run cut short mid-request): its lease
    # would expire during this one and be counted as ours. Start once P's expiries have held still
    # for a whole lease.
    quiet: dict[str, float] = {}

    def settled() -> bool:
        now, n = time.monotonic(), pc.scrape(client, real_pd.prefill_url).value(EXPIRED)
        if quiet.get("n") != n:
            quiet.update(n=n, since=now)
        return now - quiet["since"] > real_pd.lease_s + 1.0

    wait_until(
        "P's leases from earlier tests to run out", settled, timeout_s=4 * real_pd.lease_s + 10, every_s=0.5
    )
    p0 = pc.scrape(client, real_pd.prefill_url)
    body = {"model": "tiny", "prompt": unique_prompt(50, "lease"), "max_tokens": 6, "temperature": 0}
    sent = time.monotonic()
    pr = pc.prefill(client, real_pd.prefill_url, "completions", body)
    assert pr.status == 200 and pr.kv_transfer_params, pr.body
    rrid = pr.kv_transfer_params["remote_request_id"]

    # Nobody decodes: P must give the blocks back after the lease, and count it once.
    p1 = wait_until(
        "P to count the lease expiry",
        lambda: pc.scrape(client, real_pd.prefill_url),
        done=lambda m: m.value(EXPIRED) > p0.value(EXPIRED),
        timeout_s=real_pd.lease_s + 20.0,
        every_s=0.25,
    )
    waited = time.monotonic() - sent
    assert p1.value(EXPIRED) - p0.value(EXPIRED) == 1
    assert waited >= real_pd.lease_s, "blocks released before the lease ran out"  # the lease is under test
    expired_line = wait_until(
        "P's log line on the expiry",
        lambda: tail(p_log, 400),
        done=lambda t: f"Releasing expired KV blocks for request {rrid}" in t,
        timeout_s=10.0,
        every_s=0.25,
    )
    assert f"Releasing expired KV blocks for request {rrid}" in expired_line

    # Now the late decode. vLLM reads the freed blocks anyway.
    d0 = pc.scrape(client, real_pd.decode_url)
    late = pc.decode(client, real_pd.decode_url, "completions", body, pr.kv_transfer_params, pr.request_id)
    assert late.status == 200, late.raw[:500]
    assert late.body is not None and late.body["usage"]["prompt_tokens"] == pr.body["usage"]["prompt_tokens"]
    d1 = wait_until(
        "D to count the late transfer",
        lambda: pc.scrape(client, real_pd.decode_url),
        done=lambda m: (
            m.value("vllm:nixl_xfer_time_seconds_count") > d0.value("vllm:nixl_xfer_time_seconds_count")
        ),
        timeout_s=15.0,
        every_s=0.25,
    )
    assert d1.value("vllm:nixl_xfer_time_seconds_count") - d0.value("vllm:nixl_xfer_time_seconds_count") == 1
    assert d1.value("vllm:nixl_num_failed_transfers_total") == d0.value(
        "vllm:nixl_num_failed_transfers_total"
    )

    # P learns of the read of blocks it no longer tracks from D's "done" notification, which its
    # worker only drains on an engine step; an idle P takes none, so nudge it with a request.
    # Then it logs an ERROR naming the request and counts a notification after expiry.
    needle = f"Potentially invalid KV blocks for unrecognized request {rrid}"

    def nudged() -> tuple[pc.Metrics, str]:
        pc.direct(
            client,
            real_pd.prefill_url,
            "completions",
            {"model": "tiny", "prompt": unique_prompt(4, "nudge"), "max_tokens": 1},
        )
        return pc.scrape(client, real_pd.prefill_url), tail(p_log, 400)

    p2, log = wait_until(
        "P to count and log the notification after expiry",
        nudged,
        done=lambda r: r[0].value(LATE) > p0.value(LATE) and needle in r[1],
        timeout_s=20.0,
        every_s=0.5,
    )
    assert needle in log
    assert p2.value(LATE) - p0.value(LATE) == 1
    assert p2.value(EXPIRED) - p0.value(EXPIRED) == 1
