"""The proxy's scrape-time families (``proxy.metrics``) render exactly as recorded: names, help
texts, labels and values of a proxy with every live source populated, and of one with none of the
optional sources (no adaptive limit, no span export, no KV events, no table, no part of the limits).

The expected expositions are in ``tests/fixtures/metrics``; the lines are compared sorted, so a
change in the order of families alone does not fail, a changed help text or label does.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any, cast

import pytest

from proxy.metrics import LiveSources, ProxyMetrics

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "metrics"
NOW = 1000.0


class _Routing:
    def __init__(self, populated: bool) -> None:
        self.state = "static" if populated else "default"
        self.poll_failures = 3 if populated else 0
        limits = {
            "prefill": NS(max_inflight_requests=40, max_inflight_kv_bytes=4096),
            "decode": NS(max_inflight_requests=60, max_inflight_kv_bytes=8192),
        }
        self.view = NS(version=7 if populated else None, limits=limits if populated else {})
        self._share = NS(pools={"prefill": NS(share=0.5), "decode": NS(share=0.25)}, live=2)
        self.populated = populated

    def age(self, now: float) -> float | None:
        return now - 990.5 if self.populated else None

    def current_share(self, now: float) -> Any:
        return self._share if self.populated else None


class _Outliers:
    def __init__(self, populated: bool) -> None:
        self.ejections = (
            Counter({("p1", "consecutive_failures"): 2, ("d0", "probation"): 1}) if populated else {}
        )
        self._names = ["d0", "p1"] if populated else []

    def instances(self) -> list[str]:
        return self._names

    def is_ejected(self, name: str, now: float) -> bool:
        return name == "p1" and now == NOW


class _Adaptive:
    def limit(self, pool: str, max_requests: int) -> int:
        return max_requests // 2


class _Index:
    stale = {"p1"}

    def blocks(self, inst: str) -> int:
        return {"p0": 12, "p1": 0}[inst]


def _subscriber() -> Any:
    counts = NS(
        messages=Counter({"p0": 5, "p1": 2}),
        gaps=Counter({"p1": 1}),
        restarts=Counter(),
        skipped_events=Counter({"p0": 4}),
        rebuilds=Counter({"p1": 1}),
        dropped=Counter({("p0", "msgpack"): 1, ("nobody", "unknown_instance"): 2}),
        replays=Counter({("p1", "ok"): 1}),
        loop_errors=1,
        last_message={"p0": NOW - 2.5},
    )
    return NS(
        counts=counts,
        sources={"p1": None, "p0": None},
        clock=lambda: NOW,
        lock=threading.Lock(),
        index=_Index(),
    )


def _sources(populated: bool) -> LiveSources:
    admission = NS(
        requests={"prefill": 3, "decode": 5} if populated else {},
        kv_bytes={"decode": 2048} if populated else {},
        demand={"prefill": 9} if populated else {},
        waiting=4 if populated else 0,
        adaptive=_Adaptive() if populated else None,
    )
    selector = NS(inflight={"p0": 1, "d0": 2} if populated else {}, outliers=_Outliers(populated))
    spans = NS(dropped=1, unsampled=2, exported=30, failed=4, rejected=5, retries=6, queued=7)
    return LiveSources(
        routing=cast(Any, _Routing(populated)),
        admission=cast(Any, admission),
        selector=cast(Any, selector),
        budget=cast(Any, NS(balance=2.5 if populated else 0.0)),
        spans=cast(Any, spans if populated else None),
        now=lambda: NOW,
        kv_events=_subscriber() if populated else None,
        kv_trust=cast(
            Any,
            NS(
                counts=Counter({("p0", "hit"): 3, ("p1", "miss"): 1}),
                tokens=Counter({("p0", "predicted"): 96, ("p0", "reported"): 90, ("p1", "predicted"): 64}),
            ),
        )
        if populated
        else None,
    )


def _render(populated: bool) -> list[str]:
    metrics = ProxyMetrics()
    metrics.watch(_sources(populated))
    lines = metrics.render().decode().splitlines()
    return sorted(line for line in lines if "_created" not in line)  # creation times are wall-clock


@pytest.mark.parametrize("populated", [True, False], ids=["populated", "bare"])
def test_the_live_families_render_as_recorded(populated: bool) -> None:
    name = f"proxy_live_{'populated' if populated else 'bare'}.prom"
    assert _render(populated) == (FIXTURES / name).read_text(encoding="utf-8").splitlines()
