"""With tracing on, each instance exports vLLM-shaped ``llm_request`` spans over OTLP/HTTP."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pdscope import semconv
from simulator.testing import running_fleet
from tests.captures import REAL_CAPTURES

REAL_TRACES = REAL_CAPTURES / "otlp-traces.vllm-0.32.0.json"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class _Receiver(BaseHTTPRequestHandler):
    bodies: list[bytes] = []

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        type(self).bodies.append(self.rfile.read(length))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        return


@pytest.fixture()
def receiver() -> Iterator[tuple[str, list[bytes]]]:
    _Receiver.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", _Receiver.bodies
    finally:
        server.shutdown()
        server.server_close()


def _real_attribute_keys() -> set[str]:
    """The attribute keys of real vLLM 0.32.0's llm_request spans (requests sent temperature 0)."""
    if not REAL_TRACES.exists():
        return {
            semconv.GEN_AI_TTFT,
            semconv.GEN_AI_E2E,
            semconv.GEN_AI_QUEUE,
            semconv.GEN_AI_PREFILL,
            semconv.GEN_AI_DECODE,
            semconv.GEN_AI_INFERENCE,
            semconv.GEN_AI_REQUEST_ID,
            semconv.GEN_AI_PROMPT_TOKENS,
            semconv.GEN_AI_COMPLETION_TOKENS,
            semconv.GEN_AI_TOP_P,
            semconv.GEN_AI_MAX_TOKENS,
            semconv.GEN_AI_N,
        }
    keys: set[str] = set()
    for body in json.loads(REAL_TRACES.read_text())["bodies"]:
        for rs in body["otlp_json"]["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for span in ss["spans"]:
                    keys |= {a["key"] for a in span["attributes"]}
    return keys


def test_llm_request_spans_are_children_of_the_incoming_traceparent(
    receiver: tuple[str, list[bytes]],
) -> None:
    endpoint, bodies = receiver
    headers = {"X-Request-Id": "tr-1", "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    with (
        running_fleet(1, 1, latency_scale=0.1, tracing=True, otlp_endpoint=endpoint) as fleet,
        httpx.Client(timeout=10) as client,
    ):
        body = {
            "model": fleet.model_name,
            "prompt": "x " * 50,
            "max_tokens": 1,
            "temperature": 0,
            "top_p": 0.9,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        kv = client.post(fleet.prefill_urls[0] + "/v1/completions", json=body, headers=headers).json()
        body.update(max_tokens=4, kv_transfer_params=kv["kv_transfer_params"])
        assert (
            client.post(fleet.decode_urls[0] + "/v1/completions", json=body, headers=headers).status_code
            == 200
        )
    # leaving the block shut the fleet down, which flushes the exporters
    spans = {}
    for raw in bodies:
        req = ExportTraceServiceRequest.FromString(raw)
        for rs in req.resource_spans:
            resource = {a.key: a.value.string_value for a in rs.resource.attributes}
            assert resource["vllm.instrumenting_module_name"] == "vllm.llm_engine"
            for ss in rs.scope_spans:
                assert ss.scope.name == "vllm.tracing.otel"
                for span in ss.spans:
                    spans[resource["service.name"]] = span
    assert set(spans) == {"prefill-0", "decode-0"}
    real_keys = _real_attribute_keys()
    for span in spans.values():
        assert {a.key for a in span.attributes} == real_keys
    for span in spans.values():
        assert span.name == semconv.VLLM_SPAN and span.kind == span.SPAN_KIND_SERVER
        assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
        attrs = {a.key: a.value for a in span.attributes}
        assert attrs[semconv.GEN_AI_REQUEST_ID].string_value == "cmpl-tr-1-0"
        assert attrs[semconv.GEN_AI_PROMPT_TOKENS].int_value == 50
        assert semconv.GEN_AI_TEMPERATURE not in attrs  # 0 is falsy: vLLM omits it
        assert attrs[semconv.GEN_AI_TOP_P].double_value == pytest.approx(0.9)
        assert attrs[semconv.GEN_AI_N].int_value == 1  # vLLM's default, emitted as on the real capture
        for key in (
            semconv.GEN_AI_TTFT,
            semconv.GEN_AI_E2E,
            semconv.GEN_AI_QUEUE,
            semconv.GEN_AI_PREFILL,
            semconv.GEN_AI_DECODE,
            semconv.GEN_AI_INFERENCE,
        ):
            assert attrs[key].double_value >= 0.0, key
        assert span.end_time_unix_nano > span.start_time_unix_nano
    d_attrs = {a.key: a.value for a in spans["decode-0"].attributes}
    assert d_attrs[semconv.GEN_AI_COMPLETION_TOKENS].int_value == 4
    assert d_attrs[semconv.GEN_AI_MAX_TOKENS].int_value == 4
    p_attrs = {a.key: a.value for a in spans["prefill-0"].attributes}
    assert p_attrs[semconv.GEN_AI_DECODE].double_value == 0.0  # one token on P
