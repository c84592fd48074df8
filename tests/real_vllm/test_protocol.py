"""The NIXL pull protocol end to end on a real CPU vLLM pair: outputs, metrics and spans."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdscope.config import load_config
from tests.real_vllm import pd_client as pc
from tests.real_vllm.conftest import RealPD
from tests.real_vllm.pair import KV_CACHE_BYTES
from tests.real_vllm.prompts import unique_prompt
from tests.support.waiting import wait_until

pytestmark = pytest.mark.real_vllm


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60.0) as c:
        yield c


def test_pair_shape_and_config(real_pd: RealPD, client: httpx.Client, tmp_path: Path) -> None:
    p = pc.scrape(client, real_pd.prefill_url)
    d = pc.scrape(client, real_pd.decode_url)
    (info,) = [lab for lab, _ in p.samples["vllm:cache_config_info"]]
    # KV bytes per token, checked against what vLLM itself allocated.
    assert int(info["kv_cache_memory_bytes"]) == KV_CACHE_BYTES
    assert (
        int(info["kv_cache_memory_bytes"]) / int(info["kv_cache_size_tokens"]) == real_pd.kv_bytes_per_token
    )
    assert int(info["block_size"]) == real_pd.block_size
    assert int(info["num_gpu_blocks"]) * real_pd.block_size == int(info["kv_cache_size_tokens"])
    # Both carry the NIXL families; only the consumer (D) has the KV-fetch stage gauge.
    for m in (p, d):
        assert m.has("vllm:nixl_xfer_time_seconds_count")
        assert m.has("vllm:nixl_num_kv_expired_reqs_total")
    assert d.has("vllm:num_requests_kv_fetch_by_stage")
    assert not p.has("vllm:num_requests_kv_fetch_by_stage")
    settings = load_config(real_pd.write_config(tmp_path / "pdscope.yaml"))
    assert settings.model.name == real_pd.model == "tiny"
    assert [i.name for _, i in settings.instances("prefill")] == ["real-p0"]
    assert [i.url for _, i in settings.instances("decode")] == [real_pd.decode_url]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_two_step_equals_direct_run(
    real_pd: RealPD, client: httpx.Client, kind: pc.Kind, stream: bool
) -> None:
    body = pc.request_body(kind, unique_prompt(90, f"{kind}-{stream}"), max_tokens=12, stream=stream)
    expected = pc.direct(client, real_pd.prefill_url, kind, body)

    p, d = pc.two_step(client, real_pd.prefill_url, real_pd.decode_url, kind, body)

    ktp = p.kv_transfer_params
    assert ktp is not None
    prompt_tokens = p.body["usage"]["prompt_tokens"]
    assert p.body["usage"]["completion_tokens"] == 1
    assert ktp["do_remote_prefill"] is True and ktp["do_remote_decode"] is False
    assert ktp["transfer_mode"] == "pull"
    assert (ktp["remote_host"], ktp["remote_port"]) == ("127.0.0.1", real_pd.prefill_side_port)
    assert ktp["remote_num_tokens"] == prompt_tokens
    assert len(ktp["remote_block_ids"][0]) == math.ceil(prompt_tokens / real_pd.block_size)
    prefix = "cmpl-" if kind == "completions" else "chatcmpl-"
    assert ktp["remote_request_id"].startswith(prefix + p.request_id)

    assert d.status == 200, d.raw[:500]
    assert d.text == expected
    if stream:
        # vLLM merges deltas that pile up while the server is busy, so the chunk count varies.
        assert d.chunks and d.raw.rstrip().endswith("data: [DONE]")
        assert any(c["choices"] and c["choices"][0].get("finish_reason") for c in d.chunks)
    else:
        assert d.body is not None and d.body["usage"]["prompt_tokens"] == prompt_tokens


def test_decode_metrics_count_the_pulled_kv(real_pd: RealPD, client: httpx.Client) -> None:
    before = pc.scrape(client, real_pd.decode_url)
    tokens = blocks = 0
    for words in (8, 60, 150):
        body = pc.request_body("completions", unique_prompt(words, "metrics"), max_tokens=4)
        p, d = pc.two_step(client, real_pd.prefill_url, real_pd.decode_url, "completions", body)
        assert d.status == 200, d.raw[:500]
        tokens += p.body["usage"]["prompt_tokens"]
        blocks += math.ceil(p.body["usage"]["prompt_tokens"] / real_pd.block_size)

    def delta(m: pc.Metrics, name: str, **labels: str) -> float:
        return m.value(name, **labels) - before.value(name, **labels)

    after = wait_until(
        "D to count the three pulls",
        lambda: pc.scrape(client, real_pd.decode_url),
        done=lambda m: (
            delta(m, "vllm:nixl_xfer_time_seconds_count") >= 3
            and delta(m, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") >= tokens
        ),
        timeout_s=20.0,
        every_s=0.25,
    )
    # One NIXL READ per request (TP 1), the whole prompt counted as transferred, nothing recomputed.
    assert delta(after, "vllm:nixl_xfer_time_seconds_count") == 3
    assert delta(after, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == tokens
    assert delta(after, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0
    # Whole blocks move: bytes = blocks * block_size * kv_bytes_per_token.
    assert (
        delta(after, "vllm:nixl_bytes_transferred_sum")
        == blocks * real_pd.block_size * real_pd.kv_bytes_per_token
    )
    assert delta(after, "vllm:nixl_num_failed_transfers_total") == 0
    assert delta(after, "vllm:nixl_xfer_time_seconds_sum") > 0


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_llm_request_spans_join_our_trace(real_pd: RealPD, client: httpx.Client, kind: pc.Kind) -> None:
    tp = pc.make_traceparent()
    body = pc.request_body(kind, unique_prompt(30, "trace"), max_tokens=6)
    p, d = pc.two_step(client, real_pd.prefill_url, real_pd.decode_url, kind, body, traceparent=tp.header)
    assert d.status == 200 and d.body is not None

    spans = real_pd.otlp.wait_for_spans(lambda s: s.trace_id == tp.trace_id, count=2, timeout_s=20.0)
    by_service = {s.service_name: s for s in spans}
    assert set(by_service) == {real_pd.prefill_name, real_pd.decode_name}
    assert len(spans) == 2
    base = f"cmpl-{p.request_id}-0" if kind == "completions" else f"chatcmpl-{p.request_id}"
    for s in spans:
        assert (s.name, s.scope, s.kind) == ("llm_request", "vllm.tracing.otel", 2)  # 2 = SERVER
        assert s.parent_span_id == tp.span_id
        assert s.attributes["gen_ai.request.id"] == base
        assert s.attributes["gen_ai.usage.prompt_tokens"] == p.body["usage"]["prompt_tokens"]
        assert s.end_ns >= s.start_ns > 0
    pspan, dspan = by_service[real_pd.prefill_name], by_service[real_pd.decode_name]
    assert pspan.attributes["gen_ai.usage.completion_tokens"] == 1
    assert pspan.attributes["gen_ai.request.max_tokens"] == 1
    assert dspan.attributes["gen_ai.usage.completion_tokens"] == d.body["usage"]["completion_tokens"]
    assert dspan.attributes["gen_ai.request.max_tokens"] == 6
    # D's queue time includes the KV pull; P has no decode phase.
    assert pspan.attributes["gen_ai.latency.time_in_model_decode"] == 0.0
    assert dspan.attributes["gen_ai.latency.time_in_queue"] > 0
