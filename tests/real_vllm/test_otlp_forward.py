"""The session's OTLP sink forwards vLLM's raw bodies to a receiver a test plugs in."""

from __future__ import annotations

import httpx
import pytest

from tests.real_vllm import pd_client as pc
from tests.real_vllm.conftest import RealPD
from tests.real_vllm.otlp_sink import OtlpSink
from tests.real_vllm.prompts import unique_prompt

pytestmark = pytest.mark.real_vllm


def test_forward_to_passes_the_raw_bodies_through(real_pd: RealPD) -> None:
    receiver = OtlpSink().start()
    real_pd.otlp.forward_to = receiver.url
    try:
        tp = pc.make_traceparent()
        body = {"model": "tiny", "prompt": unique_prompt(20, "forward"), "max_tokens": 3, "temperature": 0}
        with httpx.Client(timeout=60.0) as c:
            _, d = pc.two_step(
                c, real_pd.prefill_url, real_pd.decode_url, "completions", body, traceparent=tp.header
            )
        assert d.status == 200
        got = receiver.wait_for_spans(lambda s: s.trace_id == tp.trace_id, count=2, timeout_s=20.0)
        assert {s.service_name for s in got} == {real_pd.prefill_name, real_pd.decode_name}
        assert all(s.parent_span_id == tp.span_id for s in got)
        # Byte for byte what vLLM sent, with its content type.
        sent = {b.body for b in real_pd.otlp.bodies()}
        assert all(b.body in sent and b.content_type == "application/x-protobuf" for b in receiver.bodies())
        assert all(result == 200 for url, result in real_pd.otlp.forward_results if url == receiver.url)
    finally:
        real_pd.otlp.forward_to = None
        receiver.stop()
