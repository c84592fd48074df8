"""The SLO window kept between ticks (controller.slowindow, controller.kept) equals a whole read.

Pure: random histories of records inserted, changed and aged out, against an oracle that judges the
window from scratch. On a store (SQLite and PostgreSQL): ticks that read only the changed records give
the same figures as ``observe``'s whole read, tick by tick, with records written by bulk insert and by
the ORM, updated late, trusted or not, and a transaction that commits after a read it began before.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import insert, update
from sqlalchemy.orm import Session, sessionmaker

from controller.kept import KeptReads
from controller.observe import _whole_slo
from controller.slowindow import SLORow, SLOWindow, WindowFigures
from pdscope.config import SLOSettings, parse_config
from pdscope.slo import slo_verdict
from pdscope.stats import percentile
from store.db import transaction
from store.models import RequestRecord
from store.queries import RecordFilter

SLO = SLOSettings.model_validate({"ttft": {"target_ms": 500}, "tpot": {"target_ms": 50}, "window_s": 30})
STATUSES = ("ok", "ok", "ok", "error", "rejected", "timeout", None)


def oracle(
    rows: dict[int, SLORow], lo: float, hi: float, senders: frozenset[str] | None
) -> WindowFigures | None:
    """The window judged from scratch, as store.queries.slo_summary does."""
    inside = [
        r
        for r in rows.values()
        if r.proxy_in is not None and lo <= r.proxy_in <= hi and (senders is None or r.sender in senders)
    ]
    if not inside:
        return None
    done = [r for r in inside if r.status == "ok"]
    statuses: dict[str | None, int] = {}
    for r in inside:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    met = sum(1 for r in done if slo_verdict(r.status, r.ttft_s, r.tpot_s, SLO).met)
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    tpots = [r.tpot_s for r in done if r.tpot_s is not None]
    return WindowFigures(
        len(inside),
        len(done),
        met,
        statuses,
        percentile(ttfts, SLO.ttft.percentile),
        percentile(tpots, SLO.tpot.percentile),
        met / max(hi - lo, 1e-9),
    )


def _row(rng: random.Random, rid: int, now: float) -> SLORow:
    return SLORow(
        rid,
        None if rng.random() < 0.05 else now - rng.uniform(-3.0, 45.0),  # some ahead of the clock, some old
        rng.choice(STATUSES),
        None if rng.random() < 0.1 else rng.choice([0.2, 0.5, 0.50001, rng.uniform(0.05, 2.0)]),
        None if rng.random() < 0.2 else rng.uniform(0.01, 0.1),
        rng.choice(["proxy-a", "proxy-b", None]),
    )


def random_ticks(
    rng: random.Random,
    window: SLOWindow,
    rows: dict[int, SLORow],
    row: Callable[[random.Random, int, float], SLORow],
    now: float,
    ticks: int = 25,
) -> Iterator[float]:
    """Seeded ticks of a kept window: each brings new records and changes to known ones (a late span),
    made by ``row`` and kept in ``rows`` (the truth an oracle reads whole), then moves the clock 0-7 s
    and slides the window; yields each tick's time."""
    for _ in range(ticks):
        changed = []
        for _ in range(rng.randint(0, 12)):
            rid = (
                rng.randint(0, 60)
                if rows and rng.random() < 0.4
                else len(rows) + 1000 + rng.randint(0, 10**6)
            )
            rows[rid] = row(rng, rid, now)
            changed.append(rows[rid])
        window.update(changed)
        now += rng.choice([0.0, 0.5, 2.0, 2.0, 7.0])
        window.slide(now)
        yield now


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), trusted=st.booleans())
def test_the_kept_window_equals_the_window_judged_from_scratch(seed: int, trusted: bool) -> None:
    rng = random.Random(seed)
    senders = frozenset({"proxy-a"}) if trusted else None
    window, rows, now = SLOWindow(30.0, senders, SLO), {}, 1000.0
    for now in random_ticks(rng, window, rows, _row, 1000.0):
        assert window.figures() == oracle(rows, now - 30.0, now, senders)
    assert all(p.at >= now - 30.0 for p in window.parts.values())  # what left the window is forgotten


def test_a_clock_that_goes_back_recounts() -> None:
    w = SLOWindow(30.0, None, SLO)
    rows = {i: SLORow(i, 100.0 + i, "ok", 0.1 * i, 0.02, None) for i in range(1, 20)}
    w.update(rows.values())
    w.slide(130.0)
    w.slide(110.0)
    assert w.figures() == oracle(rows, 80.0, 110.0, None)


def test_nothing_in_the_window_reads_as_nothing() -> None:
    w = SLOWindow(30.0, frozenset({"a"}), SLO)
    w.update([SLORow(1, 100.0, "ok", 0.1, 0.01, "b"), SLORow(2, math.nan, "ok", 0.1, 0.01, "a")])
    w.slide(110.0)
    assert w.figures() is None and not w.parts


# -- on a store ---------------------------------------------------------------------------------


@pytest.fixture
def store(store_factory: sessionmaker[Session]) -> sessionmaker[Session]:
    return store_factory


def window_settings(trusted: list[str] | None, **more: Any) -> Any:
    """A one-P one-D config with a 30 s SLO window, ``trusted`` its span senders; ``more``: further
    sections."""
    raw: dict[str, Any] = {
        "model": {"name": "m", "kv_bytes_per_token": 1024},
        "pools": {
            "p": {"role": "prefill", "instances": [{"name": "p0", "url": "http://127.0.0.1:1"}]},
            "d": {"role": "decode", "instances": [{"name": "d0", "url": "http://127.0.0.1:2"}]},
        },
        "slo": {"ttft": {"target_ms": 500}, "tpot": {"target_ms": 50}, "window_s": 30},
    }
    if trusted is not None:
        raw["controller"] = {"trusted_span_senders": trusted}
    return parse_config(yaml.safe_dump({**raw, **more}))


def _values(rng: random.Random, now: float) -> dict[str, Any]:
    r = _row(rng, 0, now)
    return {
        "proxy_in": now - 50.0 if r.proxy_in is None else r.proxy_in,  # stored: always one
        "status": r.status or "ok",
        "ttft_s": r.ttft_s,
        "tpot_s": r.tpot_s,
        "sender": r.sender,
    }


def store_tick(
    store: sessionmaker[Session],
    rng: random.Random,
    n: int,
    now: float,
    values: Callable[[random.Random, float], dict[str, Any]],
) -> int:
    """One tick's records written to ``store`` (``n`` so far, ids 1..n): new ones, and changes to known
    ones (late spans), their columns from ``values``; the count after it."""
    with transaction(store) as s:
        for _ in range(rng.randint(0, 15)):
            n += 1
            s.execute(insert(RequestRecord).values(request_id=f"r{n}", **values(rng, now)))
        for rid in rng.sample(range(1, n + 1), min(n, rng.randint(0, 6))):
            s.execute(update(RequestRecord).where(RequestRecord.id == rid).values(**values(rng, now)))
    return n


@pytest.mark.parametrize("trusted", [None, ["proxy-a"]])
def test_ticks_that_read_only_changes_give_the_whole_reads_figures(
    store: sessionmaker[Session], trusted: list[str] | None
) -> None:
    rng, settings_, kept, now, n = random.Random(5), window_settings(trusted), KeptReads(3600.0), 1000.0, 0
    only = RecordFilter(None if trusted is None else frozenset(trusted))
    for tick in range(30):
        n = store_tick(store, rng, n, now, _values)
        with transaction(store) as s:
            if tick % 7 == 3:  # through the ORM too
                rec = s.get(RequestRecord, rng.randint(1, n))
                if rec is not None:
                    rec.status, rec.ttft_s = "ok", 0.3
        now += rng.choice([0.5, 2.0, 2.0, 5.0])
        with transaction(store) as s:
            got = kept.slo(s, settings_, now)
            want = _whole_slo(s, settings_, now, only)
        assert got == want, tick
    assert kept.slo_window.counts.whole == 1 and kept.slo_window.counts.changes == 29


def test_a_write_that_commits_after_a_read_it_began_before_is_read_next_tick(
    store: sessionmaker[Session],
) -> None:
    """The writer's transaction is open (its rows stamped, not committed) while a tick reads; it commits
    after: the next tick reads its rows (PostgreSQL: its id is above the read's oldest running one;
    SQLite: its stamps above the highest committed)."""
    settings_, kept, now = window_settings(None), KeptReads(3600.0), 1000.0
    with transaction(store) as s:
        s.execute(
            insert(RequestRecord).values(request_id="before", proxy_in=now - 1, status="ok", ttft_s=0.1)
        )
    with transaction(store) as s:
        assert kept.slo(s, settings_, now) is not None
    writer = store()
    writer.execute(
        insert(RequestRecord).values(request_id="late", proxy_in=now + 0.5, status="ok", ttft_s=0.2)
    )
    writer.flush()
    if writer.get_bind().dialect.name == "postgresql":  # SQLite's one writer would block the reader's mark
        with transaction(store) as s:
            figures = kept.slo(s, settings_, now + 1)
        assert figures is not None and figures.completed == 1  # not committed: not seen yet
    writer.commit()
    writer.close()
    with transaction(store) as s:
        figures = kept.slo(s, settings_, now + 2)
        assert figures == _whole_slo(s, settings_, now + 2, RecordFilter())
    assert figures is not None and figures.completed == 2 and kept.slo_window.counts.whole == 1


def test_a_delete_inside_the_window_is_seen_by_the_next_whole_read(store: sessionmaker[Session]) -> None:
    """A delete stamps nothing. SQLite: deleting the newest rows takes the highest stamp below the mark,
    and the next read is whole. PostgreSQL: the kept window counts the deleted rows until they leave it or
    the next whole read (``whole_read_every_s``), the stated limit (retention keeps hours)."""
    settings_, kept, now = window_settings(None), KeptReads(10.0), 1000.0
    with transaction(store) as s:
        for i in range(5):
            s.execute(
                insert(RequestRecord).values(request_id=f"r{i}", proxy_in=now - i, status="ok", ttft_s=0.1)
            )
    with transaction(store) as s:
        kept.slo(s, settings_, now)
    with transaction(store) as s:
        s.query(RequestRecord).delete()
        s.execute(insert(RequestRecord).values(request_id="new", proxy_in=now, status="ok", ttft_s=0.1))
    sqlite = store().get_bind().dialect.name == "sqlite"
    with transaction(store) as s:
        figures = kept.slo(s, settings_, now + 1)
        assert (figures == _whole_slo(s, settings_, now + 1, RecordFilter())) is sqlite
    assert kept.slo_window.counts.whole == (2 if sqlite else 1)
    with transaction(store) as s:  # the whole read is due
        assert kept.slo(s, settings_, now + 11) == _whole_slo(s, settings_, now + 11, RecordFilter())


def test_the_window_is_read_whole_when_its_config_changes_or_its_time_is_due(
    store: sessionmaker[Session],
) -> None:
    kept, now = KeptReads(10.0), 1000.0
    with transaction(store) as s:
        s.execute(insert(RequestRecord).values(request_id="a", proxy_in=now - 1, status="ok", ttft_s=0.1))
    for at, trusted in ((now, None), (now + 2, None), (now + 4, ["x"]), (now + 6, ["x"]), (now + 15, ["x"])):
        with transaction(store) as s:
            kept.slo(s, window_settings(trusted), at)
    assert (kept.slo_window.counts.whole, kept.slo_window.counts.changes) == (3, 2)
