"""The proxy's local adaptive concurrency limit per pool (``proxy/concurrency.py``, issue 14:
"the data plane protects goodput on its own"). Pure tables first (injected clock), then the
limit applied by admission in a running proxy."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from pdscope.config import AdaptiveLimitSettings, ConfigError, LatencySLO, SLOSettings, parse_config
from proxy.concurrency import AdaptiveLimits
from tests.proxy.conftest import fake_fleet, make_settings, running_proxy

TARGET_S = 2.0


def _limits(**kw: Any) -> AdaptiveLimits:
    s = AdaptiveLimitSettings(
        **{
            "window_s": 1.0,
            "min_samples": 10,
            "increase": 2,
            "decrease_factor": 0.5,
            "min_limit": 2,
            "headroom": 0.8,
            **kw,
        }
    )
    return AdaptiveLimits(s, TARGET_S, 99.0)


def _window(
    lim: AdaptiveLimits,
    t0: float,
    ttfts: list[float],
    inflight: int = 40,
    ceiling: int = 256,
    pool: str = "p",
) -> float:
    """Feed one window of samples spread over [t0, t0 + 1]; returns the window's end."""
    for i, x in enumerate(ttfts):
        lim.observe(pool, x, inflight, ceiling, t0 + (i + 1) / len(ttfts))
    return t0 + 1.0


def test_a_healthy_pool_has_no_adaptive_limit() -> None:
    lim = _limits()
    t = 0.0
    for _ in range(10):
        t = _window(lim, t, [0.5] * 50)
    assert lim.limit("p", 256) == 256 and lim.reduced == {}


def test_ttft_over_target_shrinks_the_limit_multiplicatively_from_the_load_seen() -> None:
    lim = _limits()
    t = _window(lim, 0.0, [3.0] * 50, inflight=40)
    assert lim.limit("p", 256) == 20  # the peak in flight (40) x 0.5, not 256 x 0.5
    t = _window(lim, t, [3.0] * 50, inflight=20)
    assert lim.limit("p", 256) == 10
    for _ in range(10):
        t = _window(lim, t, [3.0] * 50, inflight=10)
    assert lim.limit("p", 256) == 2  # the floor (min_limit)


def test_ttft_comfortably_under_target_grows_it_additively_back_to_the_ceiling() -> None:
    lim = _limits()
    t = _window(lim, 0.0, [3.0] * 50, inflight=40)
    assert lim.limit("p", 256) == 20
    seen = []
    for _ in range(3):
        t = _window(lim, t, [1.0] * 50, inflight=20)
        seen.append(lim.limit("p", 256))
    assert seen == [22, 24, 26]
    for _ in range(200):
        t = _window(lim, t, [1.0] * 50, inflight=20)
    assert "p" not in lim.reduced and lim.limit("p", 256) == 256  # free again: follows the ceiling


def test_never_above_the_controllers_limit() -> None:
    lim = _limits()
    t = _window(lim, 0.0, [3.0] * 50, inflight=40)
    assert lim.limit("p", 256) == 20
    assert lim.limit("p", 8) == 8  # the controller cut the pool to 8: 8 is in force
    t = _window(lim, t, [1.0] * 50, inflight=8, ceiling=8)  # comfortably under at 8: free, at 8
    assert lim.limit("p", 8) == 8 and "p" not in lim.reduced
    lim2 = _limits(min_limit=50)
    _window(lim2, 0.0, [3.0] * 50, inflight=40, ceiling=30)
    assert lim2.limit("p", 30) == 30  # a floor above the ceiling never lifts it


def test_noise_within_the_target_does_not_move_it() -> None:
    lim = _limits()
    t = _window(lim, 0.0, [3.0] * 50, inflight=40)
    assert lim.limit("p", 256) == 20
    for k in range(20):  # between headroom x target and the target: hold
        t = _window(lim, t, [1.7 if i % 2 else 1.9 for i in range(50)] + [0.5 * k % 1.5], inflight=20)
    assert lim.limit("p", 256) == 20
    # one slow request in a hundred is within a p99 target; two are not
    lim = _limits()
    _window(lim, 0.0, [0.5] * 99 + [5.0])
    assert lim.reduced == {}
    _window(lim, 1.0, [0.5] * 98 + [5.0, 5.0])
    assert lim.limit("p", 256) == 20
    lim = _limits(min_samples=10)  # nor is one straggler in a small window, even over the share
    _window(lim, 0.0, [0.5] * 9 + [5.0])
    assert lim.reduced == {}


def test_no_decision_before_min_samples() -> None:
    lim = _limits(min_samples=10)
    for i in range(9):
        lim.observe("p", 5.0, 40, 256, 10.0 * i)  # windows long past, but only 9 samples
    assert lim.reduced == {}
    lim.observe("p", 5.0, 40, 256, 100.0)
    assert lim.limit("p", 256) == 20


def test_pools_are_independent() -> None:
    lim = _limits()
    _window(lim, 0.0, [3.0] * 50, pool="slow")
    _window(lim, 0.0, [0.5] * 50, pool="fast")
    assert lim.limit("slow", 256) == 20 and lim.limit("fast", 256) == 256


def test_adaptive_limit_config_is_validated() -> None:
    base = (
        "model: {name: m, kv_bytes_per_token: 1}\npools:\n  p: {role: prefill, instances: [{name: p0, url: 'http://p'}]}\n"
        "  d: {role: decode, instances: [{name: d0, url: 'http://d'}]}\n"
    )
    s = parse_config(base, "<t>")
    assert s.proxy.adaptive_limit.enabled and s.proxy.adaptive_limit.min_limit == 1
    for bad in ("{decrease_factor: 1.0}", "{min_limit: 0}", "{window_s: 0}", "{headroom: 1.5}", "{bogus: 1}"):
        with pytest.raises(ConfigError) as err:
            parse_config(base + f"proxy: {{adaptive_limit: {bad}}}\n", "<t>")
        assert "adaptive_limit" in str(err.value)


# -- applied by admission ------------------------------------------------------------------

COMPLETION = {"model": "fake", "prompt": "one two three", "max_tokens": 4}


async def test_the_adaptive_limit_is_fed_by_the_flow_and_rejects_over_it_with_a_429() -> None:
    async with fake_fleet(1, 1, hang_after_first=True) as fleet:
        settings = make_settings(
            [fleet.prefill[0].url],
            [fleet.decode[0].url],
            proxy={
                "admission": {"queue_timeout_s": 0.1},
                "adaptive_limit": {"window_s": 0.001, "min_samples": 2, "decrease_factor": 0.5},
            },
        )
        # A 1 us TTFT target at p50: every real answer is over it.
        settings = settings.model_copy(
            update={"slo": SLOSettings(ttft=LatencySLO(target_ms=0.001, percentile=50))}
        )
        async with running_proxy(settings) as (url, app), httpx.AsyncClient(timeout=10) as client:
            adaptive = app.parts.admission.adaptive
            assert adaptive is not None
            for _ in range(200):  # bounded: each whole answer is a sample for both pools
                assert (await client.post(url + "/v1/completions", json=COMPLETION)).status_code == 200
                if adaptive.limit("decode", 256) == 1 and adaptive.limit("prefill", 256) == 1:
                    break
            assert adaptive.limit("decode", 256) == 1 and adaptive.limit("prefill", 256) == 1
            metrics = (await client.get(url + "/metrics")).text
            health = (await client.get(url + "/healthz")).json()
            # One stream holds the decode pool's only slot (D hangs after its first token) ...
            async with client.stream(
                "POST", url + "/v1/completions", json={**COMPLETION, "stream": True}
            ) as held:
                assert held.status_code == 200
                # ... so the next request waits queue_timeout_s and is turned away.
                rejected = await asyncio.wait_for(client.post(url + "/v1/completions", json=COMPLETION), 5)
            rejections = (await client.get(url + "/metrics")).text
    assert 'pdscope_proxy_pool_adaptive_limit{pool="decode"} 1.0' in metrics
    assert health["pool_limits"]["decode"] == {"max_inflight_requests": 256, "adaptive_limit": 1}
    assert rejected.status_code == 429 and rejected.headers["retry-after"] == "1"
    assert rejected.json()["error"]["code"] == "adaptive_limit"
    assert 'pdscope_proxy_rejections_total{pool="decode",reason="adaptive_limit"} 1.0' in rejections


async def test_round_robin_has_no_adaptive_limit() -> None:
    async with fake_fleet(1, 1) as fleet:
        settings = make_settings(
            [fleet.prefill[0].url], [fleet.decode[0].url], proxy={"policy": "round-robin"}
        )
        async with running_proxy(settings) as (url, app), httpx.AsyncClient(timeout=10) as client:
            health = (await client.get(url + "/healthz")).json()
            metrics = (await client.get(url + "/metrics")).text
    assert app.parts.admission.adaptive is None
    assert health["pool_limits"]["decode"]["adaptive_limit"] is None
    assert "pdscope_proxy_pool_adaptive_limit{" not in metrics
