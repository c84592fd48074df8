"""The stranded-KV rule's parts (``analysis.stranded``), which the alert and the dashboard share."""

from __future__ import annotations

import math

from analysis.stranded import holds_while_idle, pending_total, to_pull


def test_a_d_missing_either_kv_fetch_gauge_cannot_be_seen() -> None:
    assert to_pull(1.0, 2.0) == 3.0
    assert to_pull(None, 2.0) is None and to_pull(1.0, None) is None and to_pull(math.nan, 0.0) is None


def test_the_total_is_unknown_when_any_d_is() -> None:
    assert pending_total([0.0, 2.0]) == 2.0 and pending_total([]) == 0.0
    assert pending_total([0.0, None]) is None and pending_total([math.nan]) is None


def test_holding_while_idle_needs_up_idle_and_usage_over_the_floor() -> None:
    assert holds_while_idle(True, 0.3, 0, 0)
    assert not holds_while_idle(True, 0.3, 0, 0, floor=0.5)  # the alert's threshold
    assert not holds_while_idle(False, 0.3, 0, 0) and not holds_while_idle(True, 0.3, 1, 0)
    assert not holds_while_idle(True, 0.3, 0, 2) and not holds_while_idle(True, None, 0, 0)
    assert not holds_while_idle(True, math.nan, 0, 0) and not holds_while_idle(True, 0.0, 0, 0)
