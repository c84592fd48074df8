"""store.regret: the bounded reads decision regret judges from, on SQLite and PostgreSQL."""

from __future__ import annotations

from pdscope.config import SLOSettings
from store import regret as reads
from store.db import make_engine, session_factory, transaction
from store.migrate import upgrade
from store.models import Decision, RequestRecord, Snapshot
from store.queries import RecordFilter


def _decision(ts: float, field: str, new: float, reason: str = "SlowHandoff") -> Decision:
    return Decision(
        ts=ts,
        tick=int(ts),
        mode="enforce",
        subject_kind="instance",
        subject="d1",
        field=field,
        old_value=1.0,
        new_value=new,
        reason=reason,
        message="",
        inputs={},
        scores={},
        leader_epoch=3,
    )


def _record(i: int, t: float, status: str, ttft: float | None, sender: str | None = "proxy") -> RequestRecord:
    return RequestRecord(
        request_id=f"r{i}",
        status=status,
        proxy_in=t,
        p_instance="p1",
        d_instance="d1",
        p_sent=t,
        p_done=t + 0.1,
        d_sent=t + 0.2,
        first_token=None if ttft is None else t + ttft,
        ttft_s=ttft,
        tpot_s=0.01,
        sender=sender,
        http_status=400 if status == "client_error" else 200,
    )


def test_the_reads_are_ordered_bounded_and_shaped_like_the_facts(store_url: str) -> None:
    upgrade(store_url)
    engine = make_engine(store_url)
    factory = session_factory(engine)
    try:
        with transaction(factory) as s:
            s.add_all(
                [
                    _decision(10.0, "weight", 0.5),
                    _decision(12.0, "weight", 1.0, "Recovering"),
                    _decision(11.0, "served_weight", 0.2, "ManualOverride"),
                    _decision(5.0, "weight", 0.1),
                ]
            )
            s.add_all(
                [
                    _record(1, 100.0, "ok", 0.5),
                    _record(2, 101.0, "ok", 3.0),
                    _record(3, 102.0, "error", None),
                    _record(4, 103.0, "client_error", 0.1),
                    _record(5, 104.0, "ok", 0.2, sender=None),
                ]
            )
            s.add_all(
                [
                    Snapshot(instance=n, pool="decode", role="decode", ts=t, up=up, kv_cache_usage=kv)
                    for n, t, up, kv in (
                        ("d1", 1.0, True, 0.2),
                        ("d1", 2.0, False, None),
                        ("d2", 1.5, True, 0.9),
                    )
                ]
            )
        slo = SLOSettings()  # TTFT 2000 ms, TPOT 100 ms
        with transaction(factory) as s:
            d = reads.decisions(s, 6.0, ["weight"], limit=10)
            assert (
                d.rows
                == (
                    (10.0, 10, "instance", "d1", "weight", 1.0, 0.5, "SlowHandoff", 3),
                    (12.0, 12, "instance", "d1", "weight", 1.0, 1.0, "Recovering", 3),
                )
                and not d.truncated
            )
            assert reads.decisions(s, 0.0, ["weight"], limit=2).truncated
            r = reads.records(
                s, 100.0, 200.0, slo, only=RecordFilter(frozenset({"proxy"}), charged_only=True), limit=10
            )
            assert [(row[0], row[1], row[-1]) for row in r.rows] == [
                (100.0, "ok", True),
                (101.0, "ok", False),
                (102.0, "error", False),
            ]
            assert r.rows[0][2:8] == ("p1", "d1", 100.0, 100.1, 100.2, 100.5)
            assert reads.records(s, 100.0, 200.0, slo, only=RecordFilter(), limit=4).truncated
            sc = reads.scrapes(s, ["d1"], 0.0, 10.0, limit=10)
            assert sc.rows == (("d1", 1.0, True, 0.2), ("d1", 2.0, False, None))
            assert reads.scrapes(s, [], 0.0, 10.0, limit=10).rows == ()
            assert reads.scrapes(s, ["d1", "d2"], 0.0, 10.0, limit=2).truncated
    finally:
        engine.dispose()
