"""The window's snapshots kept between ticks (``controller.snaprows``, ``KeptReads.snapshots``): every tick
answers what ``store.queries.snapshot_window`` reads from scratch, row for row."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from sqlalchemy import delete, insert
from sqlalchemy.orm import Session, sessionmaker

from controller.kept import KeptReads
from controller.snaprows import SnapshotRows
from store.db import transaction
from store.models import Snapshot
from store.queries import SNAPSHOT_SCALARS, snapshot_window

SPAN = 30.0
NAMES = [c.key for c in SNAPSHOT_SCALARS]


def _plain(window: dict[str, list[Any]]) -> dict[str, list[tuple[Any, ...]]]:
    """A window read's rows as tuples of the whole read's columns (a kept row also has its id)."""
    return {name: [tuple(getattr(r, c) for c in NAMES) for r in rows] for name, rows in window.items()}


def _snapshot(rng: random.Random, instance: str, ts: float) -> dict[str, Any]:
    return {
        "instance": instance,
        "pool": "p" if instance.startswith("p") else "d",
        "role": "prefill" if instance.startswith("p") else "decode",
        "ts": ts,
        "up": rng.random() > 0.1,
        "error": None,
        "num_running": rng.randint(0, 9),
        "prompt_tokens": float(rng.randint(0, 10_000)),
        "histograms": {},
    }


def _scrape_round(store: sessionmaker[Session], rng: random.Random, now: float) -> None:
    """One round of scrapes as collectors store them: most at about ``now``, some late (an older
    timestamp, stored after newer ones), some ahead of the reader's clock, some at the very same time
    as another of the same instance."""
    with transaction(store) as s:
        for name in ("p0", "p1", "d0", "d1", "d2"):
            if rng.random() < 0.15:
                continue  # a scrape that failed to arrive this round
            ts = now - rng.choice([0.0, 0.0, 0.0, 0.3, 4.0, 12.0]) + rng.choice([0.0, 0.0, 0.0, 1.5])
            s.execute(insert(Snapshot).values(**_snapshot(rng, name, round(ts, 1))))
            if rng.random() < 0.05:  # the same instant twice: ids order them, in both reads
                s.execute(insert(Snapshot).values(**_snapshot(rng, name, round(ts, 1))))


def test_kept_snapshots_equal_the_whole_read_every_tick(store_factory: sessionmaker[Session]) -> None:
    rng, kept, now = random.Random(3), KeptReads(3600.0), 1000.0
    for tick in range(60):
        _scrape_round(store_factory, rng, now)
        now += rng.choice([0.5, 2.0, 2.0, 2.0, 5.0])
        with transaction(store_factory) as s:
            got = kept.snapshots(s, SPAN, now)
            want = snapshot_window(s, now - SPAN, now)
        assert _plain(got) == _plain(want), tick
    assert kept.snapshot_window.counts.whole == 1 and kept.snapshot_window.counts.changes == 59
    assert len(want) >= 4 and sum(map(len, want.values())) > 30  # many rows, of several instances


def test_a_new_span_a_clock_gone_back_or_a_due_time_reads_whole(store_factory: sessionmaker[Session]) -> None:
    rng, kept, now = random.Random(4), KeptReads(20.0), 1000.0
    for _ in range(8):
        _scrape_round(store_factory, rng, now)
        now += 2.0

    def tick(span: float, at: float) -> None:
        with transaction(store_factory) as s:
            got = kept.snapshots(s, span, at)
            assert _plain(got) == _plain(snapshot_window(s, at - span, at))

    tick(SPAN, now)
    tick(SPAN, now + 2)
    assert (kept.snapshot_window.counts.whole, kept.snapshot_window.counts.changes) == (1, 1)
    start = now - 16.0  # the first round's time: rounds every 2 s from there
    tick(10.0, start + 6)  # a shorter span, and the clock back
    tick(10.0, start + 14)  # read by changes: it let go of what is before start + 4
    tick(10.0, start + 8)  # back before that, though after the last whole read: start - 2 .. start + 4
    tick(10.0, start + 40)  # past whole_read_every_s since the last whole read
    assert (kept.snapshot_window.counts.whole, kept.snapshot_window.counts.changes) == (4, 2)
    tick(5.0, start + 41)  # a shorter span alone: what it holds still covers it
    tick(30.0, start + 42)  # a longer one reaches before what it let go
    assert (kept.snapshot_window.counts.whole, kept.snapshot_window.counts.changes) == (5, 3)


def test_a_snapshot_far_ahead_of_the_clock_is_read_by_the_whole_read_due_before_it(
    store_factory: sessionmaker[Session],
) -> None:
    """A collector's clock far ahead (or seconds taken for milliseconds): its rows are not held until a
    whole read is due within reach of them, and then read as the whole read reads them."""
    rng, kept, now = random.Random(6), KeptReads(20.0), 1000.0
    with transaction(store_factory) as s:
        s.execute(insert(Snapshot).values(**_snapshot(rng, "p0", now)))
        s.execute(insert(Snapshot).values(**_snapshot(rng, "p1", now + 500.0)))
    for at in (now, now + 2, now + 25, now + 499, now + 501):
        with transaction(store_factory) as s:
            got = kept.snapshots(s, SPAN, at)
            assert _plain(got) == _plain(snapshot_window(s, at - SPAN, at)), at
        held = kept.snapshot_window.rows
        assert held is not None and ("p1" in held.read(-math.inf, math.inf)) == (at > now + 480), at
    assert "p1" in got and "p0" not in got


def test_snapshots_deleted_from_the_store_leave_at_the_next_whole_read(
    store_factory: sessionmaker[Session],
) -> None:
    """Retention deletes only rows long out of the window; a delete inside it (by hand) is seen at the
    next whole read (``controller.whole_read_every_s``), as the SLO window's."""
    kept, now = KeptReads(10.0), 1000.0
    with transaction(store_factory) as s:
        for ts in (now - 5, now - 4, now - 3):
            s.execute(insert(Snapshot).values(**_snapshot(random.Random(0), "p0", ts)))
    with transaction(store_factory) as s:
        assert [r.ts for r in kept.snapshots(s, SPAN, now)["p0"]] == [now - 5, now - 4, now - 3]
    with transaction(store_factory) as s:  # not the newest: SQLite's mark still holds (store.changes)
        s.execute(delete(Snapshot).where(Snapshot.ts == now - 4))
    with transaction(store_factory) as s:
        stale = [r.ts for r in kept.snapshots(s, SPAN, now + 2)["p0"]]
        fresh = [r.ts for r in kept.snapshots(s, SPAN, now + 12)["p0"]]
    assert stale == [now - 5, now - 4, now - 3] and fresh == [now - 5, now - 3]
    assert kept.snapshot_window.counts.whole == 2


@pytest.mark.parametrize("seed", range(6))
def test_rows_in_any_order_and_again_read_as_the_whole_read_sorts_them(seed: int) -> None:
    """Pure: rows handed in any order, some twice (a PostgreSQL read's overlap), slid and read over
    ``[since, until]``, equal the rows of that range sorted by (ts, id)."""
    rng = random.Random(seed)
    rows = [_Row(i, rng.choice("abc"), float(rng.randint(0, 60))) for i in range(1, 200)]
    kept = SnapshotRows()
    pending, handed = rows[:], []
    rng.shuffle(pending)
    since = 0.0
    while pending:
        k = rng.randint(1, 30)
        batch, pending = pending[:k], pending[k:]
        kept.update(batch + rng.sample(handed, min(5, len(handed))))  # and some again
        handed += batch
        since += rng.choice([0.0, 1.0, 3.0])
        kept.slide(since)
        until = since + rng.choice([10.0, SPAN, 100.0])
        want: dict[str, list[_Row]] = {}
        for r in sorted(handed, key=lambda r: (r.ts, r.id)):
            if since <= r.ts <= until:
                want.setdefault(r.instance, []).append(r)
        assert kept.read(since, until) == want
    assert len(kept) == sum(1 for r in rows if r.ts >= since)


class _Row:
    __slots__ = ("id", "instance", "ts")

    def __init__(self, id: int, instance: str, ts: float) -> None:
        self.id, self.instance, self.ts = id, instance, ts

    def __repr__(self) -> str:
        return f"_Row({self.id}, {self.instance!r}, {self.ts})"
