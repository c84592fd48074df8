"""Push mode on a real CPU vLLM pair (``NixlPushConnector``, vLLM 0.32+) through ``pdscope proxy``.

Its own pair (module scope): P and D run the push connector, which the session's shared pair does
not. Each request through the proxy goes P, then D with the keys vLLM's push proxy sends (the
default, ``proxy.push_early`` off). Each must give the text the model gives without disaggregation,
with the prompt's KV written by P (P, not D, counts the transfers in push mode) rather than computed
on D.

Opt-in (``PDSCOPE_REAL_PUSH=1``; ``conftest.py`` does not collect it otherwise, and says so at the end of
every run), not part of every run of the tier: on this vLLM (0.32.0, CPU, NIXL
1.5.1) P's worker hung within its first push handoffs in 4 of 5 runs of a fresh pair, a fault of the
build, not of the proxy; when it did not, every answer matched (docs/proxy.md, push mode).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.real_vllm import pd_client as pc
from tests.real_vllm.conftest import own_pair
from tests.real_vllm.pair import RealPair
from tests.real_vllm.prompts import unique_prompt
from tests.real_vllm.proxyproc import running_proxy
from tests.support.waiting import wait_until

pytestmark = pytest.mark.real_vllm

XFERS = "vllm:nixl_xfer_time_seconds_count"
PULLED = ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})


@dataclass
class PushPair:
    pair: RealPair
    proxy_url: str
    client: httpx.Client


@pytest.fixture(scope="module")
def push_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PushPair]:
    pair = own_pair(tmp_path_factory, "push", handoff="push")
    try:
        with running_proxy(pair, pair.logs_dir) as url, httpx.Client(timeout=120.0) as client:
            yield PushPair(pair, url, client)
    finally:
        pair.stop()


def _proxy_metric(pp: PushPair, name: str, **labels: str) -> float:
    return pc.parse_metrics(pp.client.get(pp.proxy_url + "/metrics").text).value(name, **labels)


def _wait_for_write(client: httpx.Client, p_url: str, before: float) -> pc.Metrics:
    return wait_until(
        "P to count its write into D's blocks",
        lambda: pc.scrape(client, p_url),
        done=lambda m: m.value(XFERS) > before,
        timeout_s=20.0,
        every_s=0.25,
    )


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_push_through_the_proxy_gives_the_model_s_text_with_p_writing_the_kv(
    push_pair: PushPair, kind: pc.Kind
) -> None:
    pp, client = push_pair, push_pair.client
    p_url, d_url = pp.pair.prefill.url, pp.pair.decode.url
    for i, stream in enumerate((False, True)):
        body = pc.request_body(kind, unique_prompt(80, f"push-{kind}-{i}"), max_tokens=10, stream=stream)
        want = pc.direct(client, p_url, kind, body)  # P alone, no handoff: the model's own text
        p0, d0 = pc.scrape(client, p_url), pc.scrape(client, d_url)
        resp = client.post(pp.proxy_url + pc.PATHS[kind], json=body)
        assert resp.status_code == 200, resp.text[:500]
        got = pc.stream_text(kind, resp.text) if stream else pc.response_text(kind, resp.json())
        assert got == want
        p1 = _wait_for_write(client, p_url, p0.value(XFERS))
        d1 = pc.scrape(client, d_url)
        assert p1.value(XFERS) == p0.value(XFERS) + 1
        assert d1.value(XFERS) == d0.value(XFERS)  # push mode: D records no transfer
        assert d1.value(PULLED[0], **PULLED[1]) > d0.value(PULLED[0], **PULLED[1])  # D got the prompt's KV
    assert _proxy_metric(pp, "pdscope_proxy_push_early_legs_total") == 0  # push_early is off
    assert _proxy_metric(pp, "pdscope_proxy_upstream_failures_total") == 0
