"""The bundle's HTML report, pure: self-contained, escaped, and it shows what the window held."""

from __future__ import annotations

import re
from typing import Any

from controller.bundlereport import MAX_POINTS, ReportInput, render, ttft_points, weight_series

T0 = 1_796_181_300.0  # 2026-12-02 03:15:00 UTC
LO = T0 - 900


def report(**kw: Any) -> str:
    base: dict[str, Any] = dict(
        name="pdscope-KVLeaseExpired-prefill-0-20261202T031500Z.tar.gz",
        lo=LO,
        hi=T0,
        created_at=T0 + 2,
        attribution={
            "summary": "4 of 10 requests missed their SLO",
            "top": [{"message": "prefill on prefill-0: 80% of the excess since 03:10:00 UTC (4 misses)"}],
            "groups": [
                {
                    "stage": "prefill",
                    "place": "prefill-0",
                    "cause": "slow",
                    "share": 0.8,
                    "count": 4,
                    "since": T0 - 300,
                }
            ],
        },
        records=[
            {"proxy_in": LO + 10 * k, "ttft_s": 0.2 if k % 3 else 2.5, "slo_met": bool(k % 3)}
            for k in range(10)
        ],
        decisions=[
            {
                "ts": T0 - 200,
                "subject_kind": "instance",
                "subject": "prefill-0",
                "field": "weight",
                "old_value": 1.0,
                "new_value": 0.75,
                "reason": "SlowPrefill",
                "message": "slow",
            },
            {
                "ts": T0 - 100,
                "subject_kind": "instance",
                "subject": "prefill-0",
                "field": "weight",
                "old_value": 0.75,
                "new_value": 0.5,
                "reason": "SlowPrefill",
                "message": "slower",
            },
            {
                "ts": T0 - 150,
                "subject_kind": "pool",
                "subject": "prefill",
                "field": "max_inflight_requests",
                "old_value": None,
                "new_value": 256.0,
                "reason": "Healthy",
                "message": "no pressure",
            },
        ],
        alerts=[
            {
                "rule": "KVLeaseExpired",
                "labels": {"instance": "prefill-0"},
                "state": "firing",
                "severity": "warning",
                "active_since": T0 - 5,
                "fired_at": T0,
                "resolved_at": None,
                "value": 2.0,
            }
        ],
        ttft_target_s=2.0,
        trigger={
            "alertname": "KVLeaseExpired",
            "severity": "warning",
            "labels": {"instance": "prefill-0"},
            "fired_at": T0,
            "description": "prefill-0: 2 KV leases expired",
        },
    )
    base.update(kw)
    return render(ReportInput(**base))


def test_the_report_is_one_self_contained_page() -> None:
    page = report()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<script" not in page and "<link" not in page and "<img" not in page and "@import" not in page
    assert not re.search(r"(?:src|href)\s*=", page), "nothing is loaded from anywhere"
    assert "http://" not in page and "https://" not in page and "url(" not in page
    assert page.count("<svg") == 4  # TTFT, weights, decisions lanes, alerts lanes


def test_it_names_the_trigger_the_reasons_and_the_window() -> None:
    page = report()
    assert "<b>KVLeaseExpired</b> (warning) instance=prefill-0 fired at 2026-12-02 03:15:00 UTC" in page
    assert "prefill on prefill-0: 80% of the excess since 03:10:00 UTC (4 misses)" in page
    assert "Window 2026-12-02 03:00:00 UTC .. 2026-12-02 03:15:00 UTC (900 s)." in page
    assert "TTFT target 2000 ms" in page
    assert "10 requests drawn (4 red: missed an SLO or failed)" in page
    assert "Nothing: every row of the window is inside." in page


def test_misses_are_red_and_met_ones_blue() -> None:
    page = report()
    assert page.count('fill="#d9534f" fill-opacity="0.7"') == 4
    assert page.count('fill="#1f77b4" fill-opacity="0.7"') == 6


def test_stored_text_is_escaped() -> None:
    evil = '<script>alert("x")</script>'
    page = report(
        decisions=[
            {
                "ts": T0 - 1,
                "subject": evil,
                "field": "weight",
                "old_value": 1.0,
                "new_value": 0.5,
                "reason": "SlowPrefill",
                "message": evil,
            }
        ],
        notes=[evil],
    )
    assert "<script" not in page and "&lt;script&gt;" in page


def test_an_empty_window_still_renders_and_says_so() -> None:
    page = report(
        records=[], decisions=[], alerts=[], trigger=None, attribution={"summary": "no request records"}
    )
    assert "Written on demand (pdscope bundle)." in page
    assert "No request record with a TTFT in the window." in page
    assert "No weight decision in the window" in page and "No alert was active in the window." in page
    assert "<svg" not in page


def test_notes_are_listed() -> None:
    page = report(notes=["records: cut to fit max_bytes: the newest 3 of 10 rows kept"])
    assert '<li class="note">records: cut to fit max_bytes: the newest 3 of 10 rows kept</li>' in page


def test_ttft_points_are_bounded_and_skip_records_without_a_ttft() -> None:
    recs = [{"proxy_in": LO + k * 0.1, "ttft_s": 0.1, "slo_met": True} for k in range(5 * MAX_POINTS)]
    recs.append({"proxy_in": T0, "ttft_s": None})
    pts = ttft_points(recs)
    assert len(pts) == MAX_POINTS and pts[0][0] == LO


def test_weight_series_steps_from_the_old_weight() -> None:
    decisions = [
        {"ts": T0 - 100, "subject": "d-0", "field": "weight", "old_value": 0.75, "new_value": 0.5},
        {"ts": T0 - 200, "subject": "d-0", "field": "weight", "old_value": 1.0, "new_value": 0.75},
        {"ts": T0 - 50, "subject": "decode", "subject_kind": "pool", "field": "weight", "new_value": 0.5},
        {"ts": T0 - 50, "subject": "d-1", "field": "max_inflight_requests", "new_value": 3.0},
    ]
    assert weight_series(decisions, LO, T0) == {
        "d-0": [(LO, 1.0), (T0 - 200, 0.75), (T0 - 100, 0.5), (T0, 0.5)]
    }
