"""A handoff whose first token came before its lease could run out is never an expiry's suspect.

Both times are the proxy's, so the skew allowed between the proxy's clock and P's scrapes does not
apply to them. With it, a 3 s lease (the goodput bench's) made every handoff over 1 s a suspect: a
stuck D's expiries, counted before its requests had records, went to the handoffs of the healthy D
that took its load, and the controller cut that D, the pool's last, to the floor.
"""

from __future__ import annotations

import pytest

from collector.forensics import handoffs_of, join_expiries
from store.models import RequestRecord
from store.queries import CounterStep

LEASE_S = 3.0  # the earliest expiry: 2 s after P's answer


def _record(rid: str, p_done: float, handoff_s: float | None) -> RequestRecord:
    return RequestRecord(
        request_id=rid,
        p_instance="p0",
        d_instance="d-healthy",
        proxy_in=p_done - 0.1,
        p_done=p_done,
        first_token=None if handoff_s is None else p_done + handoff_s,
        status="ok" if handoff_s is not None else "timeout",
        attributes={},
    )


@pytest.mark.parametrize(
    ("handoff_s", "suspect"),
    [
        pytest.param(1.1, False, id="first-token-1.1s-after-P: in time"),
        pytest.param(1.99, False, id="just-before-the-earliest-expiry"),
        pytest.param(2.5, True, id="past-the-earliest-expiry"),
        pytest.param(None, True, id="no-first-token"),
    ],
)
def test_only_a_handoff_still_waiting_when_its_lease_could_run_out_is_a_suspect(
    handoff_s: float | None, suspect: bool
) -> None:
    rec = _record("r", 10.0, handoff_s)
    join = join_expiries([CounterStep("p0", 11.5, 12.5, 1.0)], handoffs_of(rec), LEASE_S, {})
    assert (rec.lease_expiry_suspect is True) is suspect
    assert join.unattributed == (0 if suspect else 1)  # not explained: counted, charged to nobody
