"""What the store wrapper of SLO-miss attribution reads of a record's forensics (no database)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from analysis.attribution_records import (
    FailureSteps,
    _attempts,
    _handoff_failed,
    _lease_ds,
    _transfer_s,
    transfer_failed,
)

STEPS = FailureSteps({"decode-1": ((100.0, 101.0),)})


def nixl(**d: float) -> dict[str, Any]:
    return {"nixl": {"d": {"instance": "decode-1", **d}}}


def test_the_mean_transfer_time_of_the_handoffs_window() -> None:
    assert _transfer_s(nixl(nixl_xfer_time_count=4, nixl_xfer_time_sum=2.0)) == 0.5
    assert _transfer_s(nixl(nixl_xfer_time_count=0, nixl_xfer_time_sum=0.0)) is None
    assert _transfer_s({}) is None and _transfer_s(None) is None
    assert _transfer_s({"nixl": "junk"}) is None


def test_in_push_mode_the_transfer_figures_are_read_from_p() -> None:
    pushed = {
        "nixl": {
            "transfers_on": "p",
            "d": {"instance": "decode-1", "nixl_failed_transfers": 0},
            "p": {"instance": "prefill-0", "nixl_xfer_time_count": 2, "nixl_xfer_time_sum": 0.4},
        }
    }
    assert _transfer_s(pushed) == 0.2
    assert transfer_failed({"nixl": {**pushed["nixl"], "p": {"nixl_failed_transfers": 1}}})
    assert not transfer_failed(pushed)
    assert _transfer_s({"nixl": {**pushed["nixl"], "transfers_on": "x"}}) is None  # unknown side: D's


def test_the_ds_expired_leases_waited_on() -> None:
    entries = [{"d_instance": "decode-1"}, {"d_instance": "decode-0"}, {"d_instance": None}, "junk"]
    assert _lease_ds({"lease_expiry": entries}) == ("decode-0", "decode-1")
    assert _lease_ds({"lease_expiry": "junk"}) == ()


def test_failed_attempts_marked_where_their_d_counted_nixl_failures() -> None:
    raw = [
        {
            "stage": "decode",
            "instance": "decode-1",
            "kind": "status_500",
            "start": 100.5,
            "end": 100.6,
            "p_instance": "prefill-0",
            "p_done": 100.5,
        },
        {
            "stage": "decode",
            "instance": "decode-1",
            "kind": "timeout",
            "start": 90.0,
            "end": 95.0,
            "p_instance": "prefill-1",
        },
        {"stage": "prefill", "instance": "prefill-1", "kind": "connect", "start": 80.0, "end": 80.01},
        {"stage": "decode", "instance": 7, "kind": "x", "start": 1, "end": 2},  # no instance: left out
        "junk",
    ]
    got = _attempts({"failed_attempts": raw}, STEPS)
    assert [(a.stage, a.instance, a.kind, a.transfer_failed) for a in got] == [
        ("prefill", "prefill-1", "connect", False),
        ("decode", "decode-1", "timeout", False),
        ("decode", "decode-1", "status_500", True),
    ]


def row(**kw: Any) -> SimpleNamespace:
    base = dict(
        attributes={}, status="error", d_instance="decode-1", p_done=100.2, first_token=None, done=100.3
    )
    return SimpleNamespace(**(base | kw))


def test_a_failed_handoff_not_joined_yet_reads_its_ds_failure_counter() -> None:
    assert _handoff_failed(row(), STEPS)
    assert not _handoff_failed(row(p_done=102.0, done=102.1), STEPS)  # no step overlaps it
    assert not _handoff_failed(row(status="ok"), STEPS)
    # once joined, the join decides
    assert not _handoff_failed(row(attributes=nixl(nixl_failed_transfers=0)), STEPS)
    assert _handoff_failed(row(attributes=nixl(nixl_failed_transfers=2), status="ok"), STEPS)
