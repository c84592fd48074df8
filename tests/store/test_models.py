from __future__ import annotations

import time

from sqlalchemy import func, select

from store import (
    Alert,
    AuditEvent,
    Decision,
    InstanceRow,
    RequestRecord,
    Snapshot,
    SpanRow,
    WeightOverride,
    make_engine,
    session_factory,
    transaction,
)
from store.migrate import upgrade


def test_every_table_round_trips(store_url: str) -> None:
    upgrade(store_url)
    engine = make_engine(store_url)
    factory = session_factory(engine)
    now = time.time()
    with transaction(factory) as s:
        s.add(
            InstanceRow(
                name="decode-0",
                pool="decode",
                role="decode",
                url="http://x",
                metrics_url=None,
                labels={"gpu": "h200"},
                first_seen=now,
                last_seen=now,
            )
        )
        ov = WeightOverride(
            subject_kind="instance",
            subject="decode-0",
            weight=0.5,
            drained=False,
            reason="slow NIC",
            actor="sre",
            created=now,
            expires=now + 60,
        )
        s.add(ov)
        s.flush()
        s.add(
            AuditEvent(
                ts=now,
                actor="sre",
                action="weight.set",
                subject="decode-0",
                before={"weight": 1.0},
                after={"weight": 0.5},
                reason="slow NIC",
                override_id=ov.id,
            )
        )
        s.add(
            Snapshot(
                instance="decode-0",
                pool="decode",
                role="decode",
                ts=now,
                up=True,
                kv_cache_usage=0.42,
                nixl_xfer_time_count=22,
                nixl_kv_expired_reqs=0,
                histograms={"ttft": {"le": [0.1], "counts": [1, 2], "sum": 0.3, "count": 2}},
            )
        )
        s.add(
            SpanRow(
                trace_id="a" * 32,
                span_id="b" * 16,
                parent_span_id=None,
                name="pdscope.request",
                service="pdscope-proxy",
                kind=2,
                start_ts=now,
                end_ts=now + 1,
                status_code=1,
                attributes={"pdscope.request_id": "r1"},
                received_ts=now,
            )
        )
        s.add(
            RequestRecord(
                request_id="r1",
                trace_id="a" * 32,
                status="ok",
                proxy_in=now,
                done=now + 1,
                kv_bytes=100_000 * 327_680,
                slo_met=True,
            )
        )
        s.add(
            Decision(
                ts=now,
                tick=1,
                mode="enforce",
                subject_kind="instance",
                subject="decode-0",
                field="weight",
                old_value=1.0,
                new_value=0.75,
                reason="SlowHandoff",
                message="handoff p99 3x pool median",
                arithmetic="0.75 = max(0.05, 1.0 - 0.25)",
                inputs={"handoff_p99_s": 0.9},
                scores={"handoff": 0.3},
            )
        )
        s.add(
            Alert(
                rule="NixlLeaseExpired",
                fingerprint="f" * 16,
                state="firing",
                severity="critical",
                labels={"instance": "prefill-0"},
                annotations={"summary": "x"},
                value=3.0,
                active_since=now,
                fired_at=now,
                last_eval=now,
            )
        )
    with transaction(factory) as s:
        for model in (
            InstanceRow,
            WeightOverride,
            AuditEvent,
            Snapshot,
            SpanRow,
            RequestRecord,
            Decision,
            Alert,
        ):
            assert s.scalar(select(func.count()).select_from(model)) == 1, model.__tablename__
        snap = s.scalars(select(Snapshot)).one()
        assert snap.histograms["ttft"]["counts"] == [1, 2]
        rec = s.scalars(select(RequestRecord)).one()
        assert rec.kv_bytes == 100_000 * 327_680  # beyond 32 bits: BigInteger
        assert s.scalars(select(AuditEvent)).one().before == {"weight": 1.0}
    engine.dispose()


def test_json_refuses_infinity_on_every_backend(store_url: str) -> None:
    """PostgreSQL's json has no Infinity/NaN; SQLite must refuse them the same way."""
    import pytest

    from store import StoreError

    upgrade(store_url)
    factory = session_factory(make_engine(store_url))
    with pytest.raises((StoreError, ValueError)), transaction(factory) as s:
        s.add(
            Snapshot(
                instance="d",
                pool="p",
                role="decode",
                ts=0.0,
                up=True,
                histograms={"ttft": {"le": [float("inf")], "counts": [1], "sum": 0, "count": 1}},
            )
        )
