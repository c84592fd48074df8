"""The simulated pair speaks vLLM's HTTP API and the NIXL two-step protocol."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from collector.parse import parse_text
from simulator.testing import RunningFleet, running_fleet
from tests.captures import REAL_CAPTURES
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
OWN_FIXTURES = REAL_CAPTURES
# the keys real vLLM 0.33 P returns in pull mode (NixlPullConnectorScheduler.request_finished)
REAL_P_KEYS = {
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "remote_registration_generation",
    "transfer_mode",
}
TOY_PROXY_P_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@pytest.fixture(scope="module")
def fleet() -> Iterator[RunningFleet]:
    with running_fleet(1, 1, seed=3, latency_scale=0.1) as f:
        yield f


@pytest.fixture()
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10) as c:
        yield c


def _real_p_keys() -> set[str]:
    """Keys of P's kv_transfer_params in this project's own real captures, when they exist."""
    for path in sorted(OWN_FIXTURES.glob("*.json")) if OWN_FIXTURES.is_dir() else []:
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        stack: list[Any] = [data]
        while stack:
            item = stack.pop()
            if isinstance(item, dict):
                kv = item.get("kv_transfer_params")
                if isinstance(kv, dict) and kv.get("do_remote_prefill") is True:
                    return set(kv)
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)
    return REAL_P_KEYS


def prefill(
    client: httpx.Client, fleet: RunningFleet, rid: str, prompt: str = "hello " * 100, chat: bool = False
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": fleet.model_name,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": TOY_PROXY_P_PARAMS,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = client.post(fleet.prefill_urls[0] + path, json=body, headers={"X-Request-Id": rid})
    assert r.status_code == 200, r.text
    return dict(r.json())


def sse(lines: Iterator[str]) -> list[Any]:
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric(client: httpx.Client, url: str, name: str) -> float:
    page = parse_text(client.get(url + "/metrics").text)
    for fam in page.families.values():
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise KeyError(name)


def test_two_step_returns_the_keys_real_p_returns(fleet: RunningFleet, client: httpx.Client) -> None:
    p_resp = prefill(client, fleet, "req-1")
    kv = p_resp["kv_transfer_params"]
    assert set(kv) == _real_p_keys()
    assert p_resp["id"] == "cmpl-req-1"
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert kv["transfer_mode"] == "pull" and kv["tp_size"] == 1
    assert (
        kv["remote_request_id"].startswith("cmpl-req-1-0-")
        and len(kv["remote_request_id"]) == len("cmpl-req-1-0-") + 8
    )
    assert isinstance(kv["remote_block_ids"], list) and len(kv["remote_block_ids"][0]) == 7  # 100 tokens / 16
    assert kv["remote_num_tokens"] == 100
    assert p_resp["choices"][0]["finish_reason"] == "length" and p_resp["usage"]["completion_tokens"] == 1

    before = metric(client, fleet.decode_urls[0], "vllm:nixl_xfer_time_seconds_count")
    body = {"model": fleet.model_name, "prompt": "hello " * 100, "max_tokens": 5, "kv_transfer_params": kv}
    d_resp = client.post(
        fleet.decode_urls[0] + "/v1/completions", json=body, headers={"X-Request-Id": "req-1"}
    )
    assert d_resp.status_code == 200
    out = d_resp.json()
    assert out["id"] == "cmpl-req-1" and out["kv_transfer_params"] is None
    assert out["usage"] == {
        "prompt_tokens": 100,
        "completion_tokens": 5,
        "total_tokens": 105,
        # D: every prompt token was there before its first step (local hits + pulled from P)
        "prompt_tokens_details": {"cached_tokens": 100},
        "completion_tokens_details": None,
    }
    assert metric(client, fleet.decode_urls[0], "vllm:nixl_xfer_time_seconds_count") == before + 1
    assert metric(client, fleet.prefill_urls[0], "vllm:nixl_xfer_time_seconds_count") == 0  # pull: D observes
    assert metric(client, fleet.prefill_urls[0], "vllm:kv_cache_usage_perc") == 0.0  # P freed after the pull


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_p_response_has_the_fields_of_the_real_capture(
    fleet: RunningFleet, client: httpx.Client, chat: bool
) -> None:
    path = OWN_FIXTURES / f"prefill-response-{'chat' if chat else 'completion'}.vllm-0.32.0.json"
    real = json.loads(path.read_text())["response"]
    mine = prefill(client, fleet, "shape", chat=chat)
    assert set(mine) == set(real)
    assert set(mine["choices"][0]) == set(real["choices"][0])
    assert set(mine["usage"]) == set(real["usage"])
    assert set(mine["kv_transfer_params"]) == set(real["kv_transfer_params"])
    if chat:
        assert set(mine["choices"][0]["message"]) == set(real["choices"][0]["message"])
    assert mine["system_fingerprint"].startswith("vllm-0.32.0-")


def test_completion_stream_shapes(fleet: RunningFleet, client: httpx.Client) -> None:
    kv = prefill(client, fleet, "req-2")["kv_transfer_params"]
    body = {
        "model": fleet.model_name,
        "prompt": "hello " * 100,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": kv,
    }
    with client.stream(
        "POST", fleet.decode_urls[0] + "/v1/completions", json=body, headers={"X-Request-Id": "req-2"}
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert len(chunks) == 4
    for c in chunks:
        assert c["id"] == "cmpl-req-2" and c["object"] == "text_completion" and c["model"] == fleet.model_name
        assert set(c["choices"][0]) >= {"index", "text", "logprobs", "finish_reason"}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]


def test_chat_stream_and_non_stream_shapes(fleet: RunningFleet, client: httpx.Client) -> None:
    p_resp = prefill(client, fleet, "req-3", chat=True)
    assert p_resp["id"] == "chatcmpl-req-3" and p_resp["object"] == "chat.completion"
    assert p_resp["kv_transfer_params"]["remote_request_id"].startswith("chatcmpl-req-3-")
    body = {
        "model": fleet.model_name,
        "messages": [{"role": "user", "content": "hello " * 100}],
        "max_tokens": 3,
        "stream": True,
        "kv_transfer_params": p_resp["kv_transfer_params"],
    }
    with client.stream(
        "POST", fleet.decode_urls[0] + "/v1/chat/completions", json=body, headers={"X-Request-Id": "req-3"}
    ) as r:
        events = sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-req-3" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks).split().__len__() == 3
    plain = client.post(
        fleet.decode_urls[0] + "/v1/chat/completions",
        json={"model": fleet.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    msg = plain.json()["choices"][0]
    assert msg["message"]["role"] == "assistant" and len(msg["message"]["content"].split()) == 2


def test_without_request_id_and_without_params_d_computes_locally(
    fleet: RunningFleet, client: httpx.Client
) -> None:
    before_local = metric(client, fleet.decode_urls[0], "vllm:nixl_xfer_time_seconds_count")
    r = client.post(
        fleet.decode_urls[0] + "/v1/completions",
        json={"model": fleet.model_name, "prompt": "a b c", "max_tokens": 2},
    )
    assert r.status_code == 200
    rid = r.json()["id"]
    assert rid.startswith("cmpl-") and len(rid) == len("cmpl-") + 32
    assert metric(client, fleet.decode_urls[0], "vllm:nixl_xfer_time_seconds_count") == before_local


def test_side_endpoints_and_errors(fleet: RunningFleet, client: httpx.Client) -> None:
    assert client.get(fleet.prefill_urls[0] + "/health").status_code == 200
    models = client.get(fleet.prefill_urls[0] + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == fleet.model_name
    assert models["data"][0]["owned_by"] == "vllm"
    assert client.get(fleet.prefill_urls[0] + "/version").json() == {"version": "0.32.0"}
    r = client.post(fleet.prefill_urls[0] + "/v1/completions", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = client.post(
        fleet.prefill_urls[0] + "/v1/completions",
        json={"model": fleet.model_name, "prompt": "x", "max_tokens": 10**6},
    )
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    r = client.post(fleet.prefill_urls[0] + "/v1/completions", content=b"{not json")
    assert r.status_code == 400
    bad = {"model": fleet.model_name, "prompt": "x", "max_tokens": 1, "priority": "high"}
    r = client.post(fleet.prefill_urls[0] + "/v1/completions", json=bad)
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "BadRequestError" and err["param"] == "priority"
    r = client.post(fleet.prefill_urls[0] + "/v1/completions", json={**bad, "priority": -3})
    assert r.status_code == 200  # fcfs takes any priority and ignores it, as vLLM 0.32.0 does
    text = client.get(fleet.prefill_urls[0] + "/metrics")
    assert text.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert 'http_requests_total{handler="/v1/completions",method="POST",status="4xx"}' in text.text


def test_client_disconnect_aborts_the_request(fleet: RunningFleet, client: httpx.Client) -> None:
    d0 = fleet.decode_urls[0]

    def aborted() -> float:
        page = parse_text(client.get(d0 + "/metrics").text)
        return next(
            s.value
            for s in page.families["vllm:request_success_total"].samples
            if s.labels["finished_reason"] == "abort"
        )

    before = aborted()
    body = {"model": fleet.model_name, "prompt": "a b", "max_tokens": 5000, "stream": True}
    with httpx.Client(timeout=10) as own, own.stream("POST", d0 + "/v1/completions", json=body) as r:
        assert next(r.iter_lines()).startswith("data: ")
    # 5000 tokens would take minutes: the request ends because the client went away
    wait_until("D to end the abandoned request", lambda: metric(client, d0, "vllm:num_requests_running") == 0)
    assert aborted() == before + 1


def test_queue_limits_reject_with_503_and_count_the_reason() -> None:
    with (
        running_fleet(
            1,
            1,
            latency_scale=1.0,
            max_num_queued_reqs=1,
            prefill_tokens_per_s=1000,
            request_id_headers=True,
            kv_capacity_blocks=64,
        ) as fleet,
        httpx.Client(timeout=10) as client,
    ):
        url = fleet.prefill_urls[0] + "/v1/completions"
        body = {"model": fleet.model_name, "prompt": "x " * 900, "max_tokens": 1}  # 0.9 s, 57 of 64 blocks
        statuses: list[int] = []

        def post() -> None:
            with httpx.Client(timeout=10) as own:
                statuses.append(own.post(url, json=body).status_code)

        threads = [threading.Thread(target=post) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert 503 in statuses and 200 in statuses
        page = parse_text(client.get(fleet.prefill_urls[0] + "/metrics").text)
        rejected = {
            s.labels["reason"]: s.value for s in page.families["vllm:admission_rejections_total"].samples
        }
        assert (
            rejected["max_num_queued_reqs"] == statuses.count(503) and rejected["max_num_queued_tokens"] == 0
        )
        r = client.post(url, json={**body, "prompt": "x"}, headers={"X-Request-Id": "echo-me"})
        assert r.headers["x-request-id"] == "echo-me"
        too_big = client.post(url, json={**body, "prompt": "x " * 1100})  # 64 blocks x 16 = 1024 tokens
        assert too_big.status_code == 400 and "KV cache" in too_big.json()["error"]["message"]


def test_same_seed_same_engine_ids_and_request_ids() -> None:
    def first_params(seed: int) -> dict[str, Any]:
        with running_fleet(1, 1, seed=seed, latency_scale=0.0) as f, httpx.Client(timeout=10) as c:
            return prefill(c, f, "same")["kv_transfer_params"]  # type: ignore[no-any-return]

    a, b, other = first_params(11), first_params(11), first_params(12)
    assert a["remote_engine_id"] == b["remote_engine_id"] and a["remote_request_id"] == b["remote_request_id"]
    assert a["remote_engine_id"] != other["remote_engine_id"]
