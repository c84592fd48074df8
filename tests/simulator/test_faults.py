"""Each fault visibly moves the metric it should, over HTTP, through the admin seam."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from collector.parse import parse_text
from simulator.testing import RunningFleet, running_fleet
from tests.support.waiting import wait_until

PROMPT = "hello " * 100


@pytest.fixture(scope="module")
def fleet() -> Iterator[RunningFleet]:
    with running_fleet(1, 2, seed=5, latency_scale=1.0, lease_duration_s=1.0) as f:
        yield f


@pytest.fixture()
def client(fleet: RunningFleet) -> Iterator[httpx.Client]:
    fleet.clear_faults()
    with httpx.Client(timeout=20) as c:
        yield c
    fleet.clear_faults()


def own_client() -> httpx.Client:
    """A client for a worker thread (httpx clients are not shared across threads)."""
    return httpx.Client(timeout=20)


def value(client: httpx.Client, url: str, sample: str, **labels: str) -> float:
    page = parse_text(client.get(url + "/metrics").content)
    for fam in page.families.values():
        for s in fam.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(sample)


def two_step(
    fleet: RunningFleet, client: httpx.Client, d: int = 0, rid: str = "r", max_tokens: int = 3
) -> httpx.Response:
    body: dict[str, Any] = {
        "model": fleet.model_name,
        "prompt": PROMPT,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    p = client.post(fleet.prefill_urls[0] + "/v1/completions", json=body, headers={"X-Request-Id": rid})
    assert p.status_code == 200
    body.update(max_tokens=max_tokens, kv_transfer_params=p.json()["kv_transfer_params"])
    return client.post(fleet.decode_urls[d] + "/v1/completions", json=body, headers={"X-Request-Id": rid})


def mean_xfer(client: httpx.Client, url: str) -> tuple[float, float]:
    return (
        value(client, url, "vllm:nixl_xfer_time_seconds_sum"),
        value(client, url, "vllm:nixl_xfer_time_seconds_count"),
    )


def mean_delta(before: tuple[float, float], after: tuple[float, float]) -> float:
    return (after[0] - before[0]) / (after[1] - before[1])


@pytest.mark.parametrize("kind", ["slow_link", "slow_nic"])
def test_slow_link_and_nic_raise_transfer_time_on_that_d_only(
    fleet: RunningFleet, client: httpx.Client, kind: str
) -> None:
    d0, d1 = fleet.decode_urls
    a0 = mean_xfer(client, d0)
    for i in range(3):
        assert two_step(fleet, client, 0, f"{kind}-base-{i}").status_code == 200
    b0 = mean_xfer(client, d0)
    base = mean_delta(a0, b0)
    spec = {"kind": kind, "decode": "decode-0", "factor": 100}
    if kind == "slow_link":
        spec["prefill"] = "prefill-0"
    fleet.inject(spec)
    for i in range(3):
        assert two_step(fleet, client, 0, f"{kind}-slow-{i}").status_code == 200
    slow = mean_delta(b0, mean_xfer(client, d0))
    assert slow > 30 * base
    c1 = mean_xfer(client, d1)
    assert two_step(fleet, client, 1, f"{kind}-other").status_code == 200
    assert mean_delta(c1, mean_xfer(client, d1)) < 5 * base  # the other D's link is untouched


def test_transfer_failures_count_on_d_and_fail_the_request(fleet: RunningFleet, client: httpx.Client) -> None:
    d0 = fleet.decode_urls[0]
    failed = value(client, d0, "vllm:nixl_num_failed_transfers_total")
    errors = value(client, d0, "vllm:request_success_total", finished_reason="error")
    fleet.inject({"kind": "transfer_failure", "rate": 1.0, "decode": "decode-0"})
    r = two_step(fleet, client, 0, "fail-1")
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
    assert value(client, d0, "vllm:nixl_num_failed_transfers_total") == failed + 1
    assert value(client, d0, "vllm:request_success_total", finished_reason="error") == errors + 1
    assert two_step(fleet, client, 1, "fail-other").status_code == 200  # decode-1 unaffected


def test_d_that_stops_pulling_lets_p_leases_expire(fleet: RunningFleet, client: httpx.Client) -> None:
    p0, d0 = fleet.prefill_urls[0], fleet.decode_urls[0]
    wait_until(
        "P's KV cache to empty", lambda: value(client, p0, "vllm:kv_cache_usage_perc") == 0.0
    )  # earlier leases settled
    expired = value(client, p0, "vllm:nixl_num_kv_expired_reqs_total")
    failed = value(client, d0, "vllm:nixl_num_failed_transfers_total")
    late = value(client, p0, "vllm:nixl_num_notifications_after_expiry_total")
    pulls = value(client, d0, "vllm:nixl_xfer_time_seconds_count")
    fid = fleet.inject({"kind": "stop_pulling", "decode": "decode-0"})
    result: dict[str, httpx.Response] = {}
    worker = threading.Thread(
        target=lambda: result.setdefault("r", two_step(fleet, own_client(), 0, "stuck"))
    )
    worker.start()
    wait_until(
        "D to wait for the KV fetch",
        lambda: value(client, d0, "vllm:num_requests_kv_fetch_by_stage", stage="waiting_to_start") == 1,
    )
    assert value(client, d0, "vllm:num_requests_waiting_by_reason", reason="deferred") == 1
    wait_until(
        "P to expire the lease",
        lambda: value(client, p0, "vllm:nixl_num_kv_expired_reqs_total") == expired + 1,
    )
    assert value(client, p0, "vllm:kv_cache_usage_perc") == 0.0  # the expired lease freed P's blocks
    fleet.remove_fault(fid)
    worker.join(10)
    # as real vLLM 0.32 (tests/fixtures/vllm-0.32.0-cpu/lease-expiry...): the late pull reads the
    # freed blocks, D counts a transfer, P a notification after expiry
    assert result["r"].status_code == 200
    assert value(client, d0, "vllm:nixl_num_failed_transfers_total") == failed
    assert value(client, d0, "vllm:nixl_xfer_time_seconds_count") == pulls + 1
    assert value(client, p0, "vllm:nixl_num_notifications_after_expiry_total") == late + 1


def test_instance_down_and_back(fleet: RunningFleet, client: httpx.Client) -> None:
    d1 = fleet.decode_urls[1]
    assert two_step(fleet, client, 1, "before-down").status_code == 200
    assert value(client, d1, "vllm:request_success_total", finished_reason="length") >= 1
    fid = fleet.inject({"kind": "down", "instance": "decode-1"})

    def refused() -> bool:
        try:
            client.get(d1 + "/health")
        except httpx.TransportError:  # refused, or a kept-alive connection reset as it went down
            return True
        return False

    wait_until("decode-1 to refuse connections", refused)
    up = {i["name"]: i["up"] for i in client.get(fleet.admin_url + "/instances").json()["instances"]}
    assert up == {"prefill-0": True, "decode-0": True, "decode-1": False}
    fleet.remove_fault(fid)
    wait_until("decode-1 to answer again", lambda: not refused())
    # a restarted vLLM starts from zero
    assert value(client, d1, "vllm:request_success_total", finished_reason="length") == 0
    assert two_step(fleet, client, 1, "after-up").status_code == 200


def test_p_down_makes_ds_pull_fail(fleet: RunningFleet, client: httpx.Client) -> None:
    d0 = fleet.decode_urls[0]
    body: dict[str, Any] = {
        "model": fleet.model_name,
        "prompt": PROMPT,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    kv = client.post(fleet.prefill_urls[0] + "/v1/completions", json=body).json()["kv_transfer_params"]
    failed = value(client, d0, "vllm:nixl_num_failed_transfers_total")
    fid = fleet.inject({"kind": "down", "instance": "prefill-0"})
    body.update(max_tokens=3, kv_transfer_params=kv)
    assert client.post(d0 + "/v1/completions", json=body).status_code == 500
    assert value(client, d0, "vllm:nixl_num_failed_transfers_total") == failed + 1
    fleet.remove_fault(fid)
    wait_until("prefill-0 to answer again", lambda: _up(client, fleet))


def _up(client: httpx.Client, fleet: RunningFleet) -> bool:
    try:
        client.get(fleet.prefill_urls[0] + "/health")
    except httpx.ConnectError:
        return False
    return True


def test_kv_capacity_shrink_raises_usage_and_queues() -> None:
    # its own fleet with a 10 s lease: the queued request must be seen before the first lease expires
    # (long enough that a loaded machine still sees it; the request then waits out the lease)
    with running_fleet(1, 1, seed=5, lease_duration_s=10.0) as fleet, httpx.Client(timeout=30) as client:
        _kv_capacity_case(fleet, client)


def _kv_capacity_case(fleet: RunningFleet, client: httpx.Client) -> None:
    p0 = fleet.prefill_urls[0]
    fleet.inject({"kind": "kv_capacity", "instance": "prefill-0", "blocks": 8})
    body = {
        "model": fleet.model_name,
        "prompt": PROMPT,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert client.post(p0 + "/v1/completions", json=body).status_code == 200  # 7 blocks leased, no D pulls
    assert value(client, p0, "vllm:kv_cache_usage_perc") == pytest.approx(7 / 8)
    result: dict[str, httpx.Response] = {}
    # another prompt of the same length: the same one would share the leased blocks (prefix cache)
    other = {**body, "prompt": " ".join(f"w{i}" for i in range(len(PROMPT.split())))}
    worker = threading.Thread(
        target=lambda: result.setdefault("r", own_client().post(p0 + "/v1/completions", json=other))
    )
    worker.start()
    wait_until(
        "the request queued for capacity",  # before the first lease expires (10 s)
        lambda: value(client, p0, "vllm:num_requests_waiting_by_reason", reason="capacity") == 1,
        timeout_s=8.0,
    )
    worker.join(30)  # the first lease expires after 10 s, then the second request fits
    assert result["r"].status_code == 200


def test_slow_p_raises_its_ttft(fleet: RunningFleet, client: httpx.Client) -> None:
    p0 = fleet.prefill_urls[0]
    body = {"model": fleet.model_name, "prompt": PROMPT, "max_tokens": 1}

    def ttft_sum_count() -> tuple[float, float]:
        return (
            value(client, p0, "vllm:time_to_first_token_seconds_sum"),
            value(client, p0, "vllm:time_to_first_token_seconds_count"),
        )

    a = ttft_sum_count()
    client.post(p0 + "/v1/completions", json=body)
    b = ttft_sum_count()
    fleet.inject({"kind": "slow", "instance": "prefill-0", "factor": 100})
    client.post(p0 + "/v1/completions", json=body)
    c = ttft_sum_count()
    assert mean_delta(b, c) > 5 * mean_delta(a, b)  # 100x the model time; wide margin for a busy machine


def test_delayed_fault_with_duration_and_admin_api(fleet: RunningFleet, client: httpx.Client) -> None:
    r = client.post(
        fleet.admin_url + "/faults",
        json={"kind": "slow", "instance": "decode-0", "factor": 2, "at": 1.0, "duration": 1.0},
    )
    fid = r.json()["id"]
    listing = client.get(fleet.admin_url + "/faults").json()["faults"]
    assert [(f["id"], f["active"]) for f in listing] == [(fid, False)]
    wait_until(
        "the scheduled fault to be active",
        lambda: [f["active"] for f in client.get(fleet.admin_url + "/faults").json()["faults"]] == [True],
    )
    wait_until(
        "the scheduled fault to end", lambda: client.get(fleet.admin_url + "/faults").json()["faults"] == []
    )
    bad = client.post(fleet.admin_url + "/faults", json={"kind": "slow_link", "prefill": "prefill-0"})
    assert bad.status_code == 400 and "decode" in bad.json()["error"][0]
    unknown = client.post(fleet.admin_url + "/faults", json={"kind": "down", "instance": "nope"})
    assert unknown.status_code == 400 and "nope" in unknown.json()["error"][0]
    assert client.delete(fleet.admin_url + "/faults/9999").status_code == 404
    stats = client.get(fleet.admin_url + "/stats").json()
    assert {"loop_lag_max_s", "loop_lag_p99_s", "trustworthy"} <= set(stats)
