"""A handoff D refused as the client's error (a 4xx but 429) never gets pulled: its lease must run out.
The lease join assigns P's expiry to it first, so the D of a genuine waiting handoff on the same P is
not flagged for it (the controller then charges nobody: tests/controller/test_policy_evidence.py)."""

from __future__ import annotations

from collector.forensics import handoffs_of, join_expiries
from store.models import RequestRecord
from store.queries import CounterStep


def _record(rid: str, d: str, p_done: float, status: str, http_status: int | None) -> RequestRecord:
    return RequestRecord(
        request_id=rid,
        p_instance="p0",
        d_instance=d,
        proxy_in=p_done - 0.1,
        p_done=p_done,
        first_token=None,
        status=status,
        http_status=http_status,
        attributes={},
    )


def test_an_expiry_goes_to_the_handoff_d_refused_as_the_clients_error_first() -> None:
    genuine = _record("r-genuine", "d-slow", 10.0, "timeout", 504)  # older: it would be taken first
    refused = _record("r-refused", "d-strict", 11.0, "client_error", 400)
    step = CounterStep("p0", 40.0, 45.0, 1.0)  # one expiry, both handoffs could explain it
    join = join_expiries([step], [*handoffs_of(genuine), *handoffs_of(refused)], 30.0, {})
    assert refused.lease_expiry_suspect is True and genuine.lease_expiry_suspect is not True
    assert join.suspects == {id(refused)} and join.unattributed == 0
    assert (refused.attributes or {})["lease_expiry"][0]["p_instance"] == "p0"


def test_a_429_at_d_is_not_the_clients_error() -> None:
    busy = _record("r-busy", "d-busy", 10.0, "rejected", 429)
    other = _record("r-other", "d-other", 9.0, "timeout", 504)
    join_expiries([CounterStep("p0", 40.0, 45.0, 1.0)], [*handoffs_of(busy), *handoffs_of(other)], 30.0, {})
    assert other.lease_expiry_suspect is True and busy.lease_expiry_suspect is not True
