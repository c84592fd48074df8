"""pdscope's proxy in front of the real CPU vLLM P/D pair: same outputs, one joined trace."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdscope import semconv as sc
from pdscope.stats import percentile
from tests.real_vllm import pd_client as pc
from tests.real_vllm.conftest import RealPD
from tests.real_vllm.prompts import unique_prompt
from tests.real_vllm.proxyproc import running_proxy
from tests.support.waiting import wait_until

pytestmark = pytest.mark.real_vllm


@pytest.fixture(scope="module")
def proxy_url(real_pd: RealPD, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``pdscope proxy`` for the pair, exporting its spans to the pair's OTLP sink."""
    with running_proxy(real_pd.pair, tmp_path_factory.mktemp("proxy_real"), real_pd.otlp.url) as url:
        yield url


def _text(kind: pc.Kind, resp: httpx.Response, stream: bool) -> str:
    return pc.stream_text(kind, resp.text) if stream else pc.response_text(kind, resp.json())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_proxy_output_equals_the_protocol_run_directly(
    real_pd: RealPD, proxy_url: str, kind: pc.Kind, stream: bool
) -> None:
    body = pc.request_body(kind, unique_prompt(80, f"proxy-{kind}-{stream}"), max_tokens=12, stream=stream)
    with httpx.Client(timeout=120) as client:
        _, by_hand = pc.two_step(client, real_pd.prefill_url, real_pd.decode_url, kind, body)
        assert by_hand.status == 200, by_hand.raw[:500]
        before = pc.scrape(client, real_pd.decode_url)
        resp = client.post(proxy_url + pc.PATHS[kind], json=body)
        assert resp.status_code == 200, resp.text[:500]
        assert _text(kind, resp, stream) == by_hand.text
        # the answer really came through a NIXL pull, not a local prefill on D
        after = wait_until(
            "D to count the proxied request's pull",
            lambda: pc.scrape(client, real_pd.decode_url),
            done=lambda m: (
                m.value("vllm:nixl_xfer_time_seconds_count")
                > before.value("vllm:nixl_xfer_time_seconds_count")
            ),
            timeout_s=20.0,
            every_s=0.25,
        )
        assert after.value("vllm:prompt_tokens_by_source_total", source="local_compute") == before.value(
            "vllm:prompt_tokens_by_source_total", source="local_compute"
        )


def test_traceparent_reaches_vllm_llm_request_spans(real_pd: RealPD, proxy_url: str) -> None:
    tp = pc.make_traceparent()
    body = pc.request_body("completions", unique_prompt(40, "proxy-trace"), max_tokens=6, stream=True)
    with httpx.Client(timeout=120) as client:
        resp = client.post(proxy_url + "/v1/completions", json=body, headers={"traceparent": tp.header})
    assert resp.status_code == 200
    rid = resp.headers["x-request-id"]
    spans = real_pd.otlp.wait_for_spans(lambda s: s.trace_id == tp.trace_id, count=7, timeout_s=30.0)
    ours = {s.name: s for s in spans if s.service_name == sc.SERVICE_PROXY}
    assert set(ours) == {sc.SPAN_REQUEST, sc.SPAN_ADMISSION, sc.SPAN_PREFILL, sc.SPAN_HANDOFF, sc.SPAN_DECODE}
    root = ours[sc.SPAN_REQUEST]
    assert root.parent_span_id == tp.span_id  # the client's trace continues through the proxy
    assert root.attributes[sc.REQUEST_ID] == rid and root.attributes[sc.OUTCOME] == "ok"
    assert root.attributes[sc.P_INSTANCE] == real_pd.prefill_name
    assert root.attributes[sc.D_INSTANCE] == real_pd.decode_name
    assert root.attributes[sc.KV_BLOCKS] >= 1
    vllm = {s.service_name: s for s in spans if s.name == sc.VLLM_SPAN}
    assert set(vllm) == {real_pd.prefill_name, real_pd.decode_name}
    # P's llm_request hangs under our prefill span, D's under our decode span
    assert vllm[real_pd.prefill_name].parent_span_id == ours[sc.SPAN_PREFILL].span_id
    assert vllm[real_pd.decode_name].parent_span_id == ours[sc.SPAN_DECODE].span_id
    for s in vllm.values():
        assert s.attributes[sc.GEN_AI_REQUEST_ID] == f"cmpl-{rid}-0"
    assert vllm[real_pd.prefill_name].attributes[sc.GEN_AI_PROMPT_TOKENS] == root.attributes[sc.PROMPT_TOKENS]


BATCH = {"x-pdscope-ttft-target-ms": "600000"}


def test_the_ttft_predictor_on_the_real_pair_records_a_prediction_and_learns_it(
    real_pd: RealPD, proxy_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The predictor's error on real vLLM (CPU): 36 requests of 10 to 200 words, two at a time, each
    with a long (batch) TTFT target so that admission predicts but never rejects. Each root carries a
    prediction; once a dozen have completed, the predictions' median error is printed with its p90
    and must be under 100 %. The simulator's target (10 %) is not this one: on this CPU pair P's time
    for the same prompt length varies from 0.05 to 0.7 s, and even the best line fitted in hindsight
    to one run's P times was 17 % off at the median and 540 % at p90."""
    rng = random.Random(28)
    sizes = [rng.randint(10, 200) for _ in range(36)]

    def one(words: int) -> int:
        body = pc.request_body("completions", unique_prompt(words, "predict"), max_tokens=2, stream=True)
        with httpx.Client(timeout=120) as client:  # a batch target: admission never rejects, only predicts
            return client.post(proxy_url + "/v1/completions", json=body, headers=BATCH).status_code

    with ThreadPoolExecutor(max_workers=2) as pool:
        statuses = list(pool.map(one, sizes))
    assert statuses.count(200) == len(sizes), str(statuses)
    roots = real_pd.otlp.wait_for_spans(
        lambda s: (
            s.name == sc.SPAN_REQUEST
            and sc.PREDICTED_TTFT_S in s.attributes
            and sc.FIRST_TOKEN_NS in s.attributes
        ),
        count=len(sizes),
        timeout_s=30.0,
    )
    roots.sort(key=lambda s: s.start_ns)
    assert all(s.attributes[sc.PREDICT_SOURCE] in sc.PREDICT_SOURCES for s in roots)
    errors = [
        abs((s.attributes[sc.FIRST_TOKEN_NS] - s.start_ns) / 1e9 / s.attributes[sc.PREDICTED_TTFT_S] - 1.0)
        for s in roots[12:]
    ]
    median, p90 = percentile(errors, 50), percentile(errors, 90)
    assert median is not None and p90 is not None
    with capsys.disabled():  # into the test log, where issue 28's real-pair figures are read from
        print(
            f"\nreal vLLM TTFT predictor: median |obs/pred - 1| {median:.1%}, p90 {p90:.1%} (n={len(errors)})"
        )
    assert median < 1.0  # within 2x: the configured prior (a GPU's 16 k tokens/s) is 5-10x off here
