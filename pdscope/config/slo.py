"""The ``slo`` section: what the service promises its users (TTFT, TPOT, goodput)."""

from __future__ import annotations

from pydantic import Field

from pdscope.config.base import PositiveFloat, PositiveFraction, _Frozen


class LatencySLO(_Frozen):
    target_ms: PositiveFloat
    """the latency target in milliseconds: a request meets the SLO at or under it"""
    percentile: float = Field(default=99.0, gt=0, lt=100)
    """the percentile of the window's requests held against target_ms (alerts, admission, dashboard)"""


class SLOSettings(_Frozen):
    ttft: LatencySLO = LatencySLO(target_ms=2000.0, percentile=99.0)
    """time to first token as the client sees it at the proxy (admission wait, prefill, KV handoff, D's first
    token)"""
    tpot: LatencySLO = LatencySLO(target_ms=100.0, percentile=99.0)
    """time per output token after the first (decode speed)"""
    goodput_attainment: PositiveFraction = 0.9
    """share of completed requests that must meet every SLO (both TTFT and TPOT); GoodputAttainmentLow fires
    below it"""
    window_s: PositiveFloat = 300.0
    """seconds of completed requests the SLO figures (alerts, GET /v1/slo) are computed over"""
    handoff_budget_ms: float | None = Field(default=None, gt=0)
    """budget of the P->D handoff (P done to D's first token) at p99: HandoffP99OverBudget and the D pools'
    backlog pressure; default: half of ttft.target_ms"""
