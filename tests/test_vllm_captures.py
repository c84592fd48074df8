"""The committed real-vLLM captures (tests/fixtures/vllm-0.32.0-cpu/) parse and hold what we rely on.

They come from ``tests/real_vllm/capture_fixtures.py`` run against a real CPU vLLM P/D pair; the
collector and the simulator are checked against them, so a broken or truncated capture must
fail here, in the unit tier, without vLLM installed.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.captures import REAL_CAPTURES
from tests.real_vllm.otlp_sink import body_to_json, decode_spans
from tests.real_vllm.pd_client import Metrics, parse_metrics

VERSION = "vllm-0.32.0"
DIR = REAL_CAPTURES

CORE_FAMILIES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_by_source_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_sum",
    "vllm:cache_config_info",
    "vllm:nixl_xfer_time_seconds_count",
    "vllm:nixl_post_time_seconds_count",
    "vllm:nixl_bytes_transferred_sum",
    "vllm:nixl_num_descriptors_count",
    "vllm:nixl_num_failed_transfers_total",
    "vllm:nixl_num_failed_notifications_total",
    "vllm:nixl_num_kv_expired_reqs_total",
    "vllm:nixl_num_notifications_after_expiry_total",
]


def _metrics(role: str, when: str) -> Metrics:
    return parse_metrics((DIR / f"{role}-metrics-{when}.{VERSION}.txt").read_text())


def _json(name: str) -> Any:
    return json.loads((DIR / f"{name}.{VERSION}.json").read_text())


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_metrics_pages_hold_the_families(role: str, when: str) -> None:
    m = _metrics(role, when)
    missing = [f for f in CORE_FAMILIES if not m.has(f)]
    assert not missing
    assert m.has("vllm:num_requests_kv_fetch_by_stage") == (role == "decode")
    assert {lab["model_name"] for lab, _ in m.samples["vllm:num_requests_running"]} == {"tiny"}


def test_traffic_shows_in_the_after_pages() -> None:
    d0, d1 = _metrics("decode", "before"), _metrics("decode", "after")
    p1 = _metrics("prefill", "after")
    assert d0.value("vllm:nixl_xfer_time_seconds_count") == 0
    assert d1.value("vllm:nixl_xfer_time_seconds_count") > 0
    assert d1.value("vllm:nixl_bytes_transferred_sum") > 0
    ext = d1.value("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert ext > 0 and d1.value("vllm:prompt_tokens_by_source_total", source="local_compute") == 0
    # P computes, D pulls: P transfers nothing in pull mode.
    assert p1.value("vllm:nixl_xfer_time_seconds_count") == 0
    assert p1.value("vllm:prompt_tokens_by_source_total", source="local_compute") > 0
    assert p1.value("vllm:request_success_total", finished_reason="length") > 0


@pytest.mark.parametrize("name", ["completion", "chat"])
def test_prefill_responses_carry_kv_transfer_params(name: str) -> None:
    cap = _json(f"prefill-response-{name}")
    assert cap["request"]["kv_transfer_params"]["do_remote_decode"] is True
    assert cap["request"]["max_tokens"] == 1 and cap["request"]["stream"] is False
    ktp = cap["response"]["kv_transfer_params"]
    for key in (
        "remote_engine_id",
        "remote_block_ids",
        "remote_request_id",
        "remote_host",
        "remote_port",
        "tp_size",
        "remote_num_tokens",
        "transfer_mode",
    ):
        assert key in ktp, key
    assert ktp["do_remote_prefill"] is True and ktp["transfer_mode"] == "pull"
    assert ktp["remote_num_tokens"] == cap["response"]["usage"]["prompt_tokens"]
    assert ktp["remote_request_id"].startswith(("cmpl-", "chatcmpl-")[name == "chat"] + cap["x_request_id"])


def test_otlp_bodies_hold_llm_request_spans_under_our_traceparents() -> None:
    index = _json("otlp-traces")
    sent = {t["trace_id"]: t for t in index["sent"]}
    spans = []
    for entry in index["bodies"]:
        raw = (DIR / entry["file"]).read_bytes()
        assert body_to_json(raw) == entry["otlp_json"]
        spans.extend(decode_spans(raw))
    requests = [s for s in spans if s.name == "llm_request" and s.trace_id in sent]
    for trace_id, t in sent.items():
        mine = [s for s in requests if s.trace_id == trace_id]
        assert sorted(s.service_name for s in mine) == ["real-d0", "real-p0"], t
        parent = t["traceparent"].split("-")[2]
        assert all(s.parent_span_id == parent for s in mine)
        for s in mine:
            assert "gen_ai.latency.time_to_first_token" in s.attributes
            assert "gen_ai.usage.prompt_tokens" in s.attributes
            assert s.attributes["gen_ai.request.id"].endswith(
                t["x_request_id"] + ("-0" if t["kind"] == "completions" else "")
            )


def test_lease_expiry_capture_records_the_late_decode() -> None:
    cap = _json("lease-expiry")
    assert cap["prefill_counter_deltas_when_expired"]["vllm:nixl_num_kv_expired_reqs_total"] == 1
    assert cap["seconds_from_prefill_to_expired_counter"] >= cap["kv_lease_duration_s"]
    assert isinstance(cap["late_decode"]["status"], int)
    assert any("Releasing expired KV blocks" in line for line in cap["prefill_log_lines"])
