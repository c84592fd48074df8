"""The collectors' membership in the store and each one's share of the targets.

Time is a hand-driven clock: a collector "dies" by no longer calling ``refresh``; nothing
sleeps. The tests on ``store_url`` run on SQLite (unit tier) and on PostgreSQL (pg tier).
"""

from __future__ import annotations

import logging
import threading

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from collector.membership import (
    HOLDING,
    JOINING,
    OK,
    SOLO,
    STANDING_DOWN,
    STARTING,
    Beat,
    Membership,
    Shard,
    shared_store,
)
from collector.selfmetrics import CollectorMetrics
from collector.targets import ScrapeTarget
from store.db import StoreError, make_engine, session_factory
from store.models import CollectorMember
from tests.support.waiting import async_wait_until

INTERVAL_S = 5.0
WINDOW_S = 3 * INTERVAL_S
T0 = 1_800_000_000.0
TARGETS = [
    ScrapeTarget(f"{pool}-{i}", pool, pool, f"http://10.0.0.{i}:8000", f"http://10.0.0.{i}:8000/metrics")
    for pool in ("prefill", "decode")
    for i in range(6)
]
ALL = {t.name for t in TARGETS}


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now

    def at(self, offset_s: float) -> None:
        self.now = T0 + offset_s


@pytest.fixture
def factory(store_factory: sessionmaker[Session]) -> sessionmaker[Session]:
    return store_factory


def _shard(factory: sessionmaker[Session], me: str, clock: Clock) -> Shard:
    return Shard(
        TARGETS,
        me,
        membership=Membership(factory, me, window_s=WINDOW_S),
        interval_s=INTERVAL_S,
        timeout_s=10.0,
        metrics=CollectorMetrics(),
        clock=clock,
    )


def _names(targets: list[ScrapeTarget]) -> set[str]:
    return {t.name for t in targets}


def _gauge(shard: Shard, name: str) -> float | None:
    return shard.metrics.registry.get_sample_value(name)


# -- the table ------------------------------------------------------------------------------


def test_a_beat_reads_who_is_live(factory: sessionmaker[Session]) -> None:
    a = Membership(factory, "a:4318", window_s=WINDOW_S)
    b = Membership(factory, "b:4318", window_s=WINDOW_S)
    assert a.beat(T0).live == ("a:4318",)
    assert b.beat(T0 + 1).live == ("a:4318", "b:4318")
    # live means heard from less than the window ago
    assert b.beat(T0 + WINDOW_S - 0.5).live == ("a:4318", "b:4318")
    assert b.beat(T0 + WINDOW_S).live == ("b:4318",)
    assert a.beat(T0 + WINDOW_S + 1).live == ("a:4318", "b:4318")


def test_leaving_deletes_only_ones_own_row(factory: sessionmaker[Session]) -> None:
    a = Membership(factory, "a", window_s=WINDOW_S)
    b = Membership(factory, "b", window_s=WINDOW_S)
    a.beat(T0)
    b.beat(T0)
    a.leave()
    assert b.beat(T0 + 1).live == ("b",)
    # a newer process under the same id is not deleted by an older one leaving late
    newer = Membership(factory, "b", window_s=WINDOW_S)
    newer.beat(T0 + 2)
    b.leave()
    assert newer.beat(T0 + 3).live == ("b",)


def test_rows_of_collectors_gone_for_a_day_are_deleted(factory: sessionmaker[Session]) -> None:
    Membership(factory, "old", window_s=WINDOW_S).beat(T0)
    Membership(factory, "new", window_s=WINDOW_S).beat(T0 + 86_400 + 1)
    with factory() as s:
        assert list(s.scalars(select(CollectorMember.id))) == ["new"]


def test_two_live_processes_under_one_id_are_noticed(factory: sessionmaker[Session]) -> None:
    first = Membership(factory, "same", window_s=WINDOW_S)
    assert not first.beat(T0).duplicate
    second = Membership(factory, "same", window_s=WINDOW_S)
    assert not second.beat(T0 + 1).duplicate  # a restart under the same id looks like this
    assert first.beat(T0 + 5).duplicate  # but then the first one is still beating
    assert second.beat(T0 + 6).duplicate
    with factory() as s:
        row = s.get(CollectorMember, "same")
        assert row is not None and row.heartbeat == T0 + 6 and row.started == T0 + 1


def test_only_a_shared_store_has_a_membership(store_url: str) -> None:
    engine = make_engine(store_url)
    try:
        assert shared_store(session_factory(engine)) == (not store_url.startswith("sqlite"))
    finally:
        engine.dispose()


# -- two collectors on one store -------------------------------------------------------------


async def test_two_collectors_split_the_targets_and_one_takes_over_a_dead_ones(
    factory: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    a, b = _shard(factory, "collector-a:4318", clock), _shard(factory, "collector-b:4318", clock)
    caplog.set_level(logging.INFO, logger="collector.membership")

    # a is alone and scrapes everything; b joins and waits one round for a to see it
    assert _names(await a.refresh()) == ALL and a.state == OK
    assert await b.refresh() == [] and b.state == JOINING
    # next round: each scrapes its own share, never the same instance
    clock.at(INTERVAL_S)
    share_a, share_b = _names(await a.refresh()), _names(await b.refresh())
    assert share_a and share_b and not share_a & share_b and share_a | share_b == ALL
    assert a.report()["live"] == b.report()["live"] == ["collector-a:4318", "collector-b:4318"]
    assert a.report()["shares"] == {"collector-a:4318": len(share_a), "collector-b:4318": len(share_b)}
    assert _gauge(a, "pdscope_collector_owned_targets") == len(share_a)
    assert _gauge(b, "pdscope_collector_live_collectors") == 2
    assert "collector-a:4318 (ok) now scrapes" in caplog.text

    # b dies after its heartbeat at INTERVAL_S: while it counts as live, a keeps to its share
    last_b_beat = INTERVAL_S
    for offset in (2 * INTERVAL_S, 3 * INTERVAL_S):
        clock.at(offset)
        assert _names(await a.refresh()) == share_a, offset
    # a's first round a full window after b's last heartbeat takes b's instances over
    clock.at(last_b_beat + WINDOW_S)
    caplog.clear()
    assert _names(await a.refresh()) == ALL
    assert a.report()["live"] == ["collector-a:4318"]
    assert _gauge(a, "pdscope_collector_owned_targets") == len(ALL)
    assert f"took {sorted(share_b)[:10]}" in caplog.text


async def test_a_clean_leave_hands_the_share_over_at_the_next_round(factory: sessionmaker[Session]) -> None:
    clock = Clock()
    a, b = _shard(factory, "a", clock), _shard(factory, "b", clock)
    await a.refresh()
    await b.refresh()
    clock.at(INTERVAL_S)
    assert _names(await a.refresh()) != ALL
    await b.refresh()
    b.leave()
    clock.at(INTERVAL_S + 0.1)
    assert _names(await a.refresh()) == ALL


async def test_a_third_collector_takes_about_a_third_from_each(factory: sessionmaker[Session]) -> None:
    clock = Clock()
    shard = {m: _shard(factory, m, clock) for m in ("a", "b", "c")}
    for m in ("a", "b"):
        await shard[m].refresh()
    clock.at(INTERVAL_S)
    before = {m: _names(await shard[m].refresh()) for m in ("a", "b")}
    assert await shard["c"].refresh() == [] and shard["c"].state == JOINING
    clock.at(2 * INTERVAL_S)
    after = {m: _names(await s.refresh()) for m, s in shard.items()}
    assert after["a"] <= before["a"] and after["b"] <= before["b"]  # c takes, nothing else moves
    assert after["c"] and after["a"] | after["b"] | after["c"] == ALL
    assert not (after["a"] & after["b"] or after["a"] & after["c"] or after["b"] & after["c"])


# -- when the store does not answer ----------------------------------------------------------


class FakeHeartbeats:
    """Answers with a fixed live set, or raises while ``failing``, or blocks while ``hung``."""

    def __init__(self, live: tuple[str, ...]) -> None:
        self.live = live
        self.failing = False
        self.hung = threading.Event()
        self.release = threading.Event()
        self.calls = 0
        self.left = False

    def beat(self, now: float) -> Beat:
        self.calls += 1
        if self.hung.is_set():
            self.release.wait(30)
        if self.failing:
            raise StoreError("connection refused")
        return Beat(self.live, duplicate=False)

    def leave(self) -> None:
        self.left = True


def _fake_shard(fake: FakeHeartbeats, clock: Clock, timeout_s: float = 10.0) -> Shard:
    return Shard(
        TARGETS,
        "a",
        membership=fake,
        interval_s=INTERVAL_S,
        timeout_s=timeout_s,
        metrics=CollectorMetrics(),
        clock=clock,
    )


def _errors(shard: Shard, reason: str) -> float | None:
    return shard.metrics.registry.get_sample_value(
        "pdscope_collector_membership_errors_total", {"reason": reason}
    )


async def test_without_the_store_the_last_share_is_kept_for_the_window_then_given_up() -> None:
    clock, fake = Clock(), FakeHeartbeats(("a", "b"))
    shard = _fake_shard(fake, clock)
    await shard.refresh()
    clock.at(INTERVAL_S)
    share = _names(await shard.refresh())
    assert shard.state == OK and 0 < len(share) < len(ALL)

    fake.failing = True  # a short outage: its peers still count it live, it keeps its share
    clock.at(2 * INTERVAL_S)
    assert _names(await shard.refresh()) == share and shard.state == HOLDING
    fake.failing = False
    clock.at(3 * INTERVAL_S)
    assert _names(await shard.refresh()) == share and shard.state == OK

    fake.failing = True  # a long one
    for offset in (4 * INTERVAL_S, 5 * INTERVAL_S):
        clock.at(offset)
        assert _names(await shard.refresh()) == share and shard.state == HOLDING
    clock.at(3 * INTERVAL_S + WINDOW_S)  # now its peers count it dead and scrape its share
    assert await shard.refresh() == [] and shard.state == STANDING_DOWN
    assert _errors(shard, "store") == 4
    assert "connection refused" in shard.report()["last_error"]
    assert _gauge(shard, "pdscope_collector_owned_targets") == 0

    fake.failing = False  # back: a joining round first, so that its peers hand its share back
    clock.at(4 * INTERVAL_S + WINDOW_S)
    assert await shard.refresh() == [] and shard.state == JOINING
    assert "last_error" not in shard.report()
    clock.at(5 * INTERVAL_S + WINDOW_S)
    assert _names(await shard.refresh()) == share and shard.state == OK


async def test_before_any_heartbeat_is_stored_nothing_is_scraped() -> None:
    clock, fake = Clock(), FakeHeartbeats(("a",))
    fake.failing = True
    shard = _fake_shard(fake, clock)
    assert await shard.refresh() == [] and shard.state == STARTING
    fake.failing = False
    clock.at(INTERVAL_S)
    assert _names(await shard.refresh()) == ALL and shard.state == OK  # alone: no joining round


async def test_a_hung_store_call_is_bounded_and_never_doubled() -> None:
    clock, fake = Clock(), FakeHeartbeats(("a",))
    shard = _fake_shard(fake, clock, timeout_s=0.5)
    assert _names(await shard.refresh()) == ALL
    fake.hung.set()
    clock.at(INTERVAL_S)
    assert _names(await shard.refresh()) == ALL and shard.state == HOLDING
    clock.at(2 * INTERVAL_S)
    assert _names(await shard.refresh()) == ALL and shard.state == HOLDING
    assert fake.calls == 2  # the hung call is not started again while it runs
    assert _errors(shard, "timeout") == 2
    fake.hung.clear()
    fake.release.set()
    await async_wait_until("the hung call to end", lambda: not shard.waiting)
    clock.at(3 * INTERVAL_S)
    assert _names(await shard.refresh()) == ALL and shard.state == OK and fake.calls == 3


async def test_a_duplicate_id_is_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    class Duplicate(FakeHeartbeats):
        def beat(self, now: float) -> Beat:
            return Beat(("a",), duplicate=True)

    shard = _fake_shard(Duplicate(("a",)), Clock())
    await shard.refresh()
    assert _errors(shard, "duplicate_id") == 1
    assert "collector id 'a' is used by another live process" in caplog.text


async def test_alone_it_scrapes_everything_and_touches_no_store() -> None:
    shard = Shard(
        TARGETS,
        "solo:4318",
        membership=None,
        interval_s=INTERVAL_S,
        timeout_s=1.0,
        metrics=CollectorMetrics(),
    )
    assert _names(await shard.refresh()) == ALL
    report = shard.report()
    assert report["state"] == SOLO and report["live"] == ["solo:4318"] and report["owned_targets"] == 12
    assert shard.runs_maintenance()
    shard.leave()  # nothing to delete


async def test_maintenance_runs_on_the_smallest_live_id_only(factory: sessionmaker[Session]) -> None:
    clock = Clock()
    a, b = _shard(factory, "a", clock), _shard(factory, "b", clock)
    await a.refresh()
    await b.refresh()
    clock.at(INTERVAL_S)
    await a.refresh()
    await b.refresh()
    assert a.runs_maintenance() and not b.runs_maintenance()


def test_handing_a_target_over_drops_its_per_target_series() -> None:
    from collector.scraper import ScrapeResult

    metrics = CollectorMetrics()
    gone, kept = TARGETS[0], TARGETS[1]
    metrics.observe_round(
        [ScrapeResult(gone, T0, 0.1, None, "HTTP 500"), ScrapeResult(kept, T0, 0.1, None, "HTTP 500")]
    )
    metrics.forget([gone])
    metrics.forget([gone])  # twice is harmless
    value = metrics.registry.get_sample_value

    def series(t: ScrapeTarget) -> list[float | None]:
        return [
            value("pdscope_collector_target_up", {"instance": t.name, "pool": t.pool, "role": t.role}),
            value("pdscope_collector_scrape_duration_seconds", {"instance": t.name}),
            value("pdscope_collector_scrape_body_bytes", {"instance": t.name}),
            value("pdscope_collector_target_last_error", {"instance": t.name, "error": "HTTP 500"}),
        ]

    assert series(gone) == [None, None, None, None]
    assert series(kept) == [0.0, 0.1, 0.0, 1.0]
