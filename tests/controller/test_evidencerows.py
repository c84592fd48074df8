"""The evidence window kept between ticks (controller.evidencerows, controller.kept) equals a whole read.

On a store (SQLite and PostgreSQL): ticks of records inserted and updated late (P done, the first token,
the outcome), some ahead of the clock, some from a sender the controller does not believe, the clock
stepping on by uneven steps: each tick's tally, rate facts, handoff figures and whole observation from the
kept window equal those of ``observe``'s whole read of the same store, tick by tick.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from sqlalchemy import delete
from sqlalchemy.orm import Session, sessionmaker

from analysis.rates import RateFacts
from controller.evidencerows import EvidenceRows
from controller.handoffgroups import BYS
from controller.kept import KeptReads
from controller.observe import _charged, observe
from controller.policy.config import PolicyConfig
from store.db import transaction
from store.models import RequestRecord
from store.queries import handoff_stats_of
from tests.controller.test_kepttally import assert_same
from tests.controller.test_slowindow import store_tick, window_settings


@pytest.fixture
def store(store_factory: sessionmaker[Session]) -> sessionmaker[Session]:
    return store_factory


def _maybe(rng: random.Random, value: float) -> float | None:
    return None if rng.random() < 0.2 else value


def _values(rng: random.Random, now: float) -> dict[str, Any]:
    """A record's columns, as the collector writes them at some stage of the request."""
    t_in = now - rng.random() * 40.0 + (3.0 if rng.random() < 0.05 else 0.0)  # a few ahead of the clock
    p_done = t_in + rng.random()
    return {
        "proxy_in": t_in,
        "sender": rng.choice(["proxy-a", "proxy-a", "proxy-b", None]),
        "p_instance": rng.choice(["p0", "p0", "p1", None]),
        "d_instance": rng.choice(["d0", "d0", "d1", None]),
        "p_pool": rng.choice(["p", "p", None]),
        "d_pool": rng.choice(["d", "d", None]),
        "status": rng.choice(["ok", "ok", "ok", "error", "timeout", "cancelled", "rejected"]),
        "http_status": rng.choice([None, None, 400, 429, 500]),
        "p_sent": _maybe(rng, t_in + 0.05),
        "p_done": _maybe(rng, p_done),
        "d_sent": _maybe(rng, t_in + 0.06),
        "first_token": _maybe(rng, p_done + rng.random() * 0.3),
        "done": _maybe(rng, p_done + 2.0),
        "ttft_s": _maybe(rng, p_done + 0.2 - t_in),
        "kv_bytes": rng.choice([None, 4096, 1 << 20]),
        "error": rng.choice([None, "upstream_status_503", "upstream_timeout"]),
        "lease_expiry_suspect": rng.random() < 0.1,
        "p_queue_s": _maybe(rng, rng.random() * 0.1),
        "retries": rng.choice([0, 0, 1]),
        "prompt_tokens": rng.choice([None, 100, 2000]),
        "p_cached_tokens": rng.choice([None, 0, 64]),
        "predict_tokens_ahead": rng.choice([None, 0, 512]),
        "predict_tokens": rng.choice([None, 1000]),
    }


def _write(store: sessionmaker[Session], rng: random.Random, n: int, now: float) -> int:
    """One tick's writes: new records, and late spans changing known ones; the count after it."""
    return store_tick(store, rng, n, now, _values)


def _both(session: Session, settings: Any, kept: KeptReads, now: float) -> None:
    """The kept tick's tally and rate facts against the whole read's."""
    evc, since = PolicyConfig.from_settings(settings).evidence, now - settings.controller.window_s
    kept_facts: list[RateFacts] = []
    whole_facts: list[RateFacts] = []
    got = _charged(session, settings, evc, since, now, kept_facts, kept)
    want = _charged(session, settings, evc, since, now, whole_facts)
    assert_same(got, want)
    assert kept_facts == whole_facts  # the same, in the same order: the rates' fit sums in it
    assert kept.evidence_window.rows is not None  # and each group's handoff figures, kept until it changes
    assert kept.evidence_window.rows.handoffs.stats() == handoff_stats_of(want.charged_handoffs, BYS)


@pytest.mark.parametrize("trusted", [None, ["proxy-a"]])
def test_ticks_that_read_only_changes_charge_as_the_whole_read(
    store: sessionmaker[Session], trusted: list[str] | None
) -> None:
    rng, settings, kept, now, n = random.Random(11), window_settings(trusted), KeptReads(3600.0), 1000.0, 0
    for tick in range(40):
        n = _write(store, rng, n, now)
        now += rng.choice([0.5, 2.0, 2.0, 5.0])
        with transaction(store) as s:
            _both(s, settings, kept, now)
            if tick % 10 == 9:  # and everything the tick decides on
                assert observe(s, settings, now, kept=kept) == observe(s, settings, now), tick
    assert kept.evidence_window.counts.whole == 1
    assert kept.evidence_window.counts.changes == 40 + 4 - 1  # the observations read it too


def test_a_clock_gone_back_or_a_longer_window_is_read_whole(store: sessionmaker[Session]) -> None:
    rng, settings, kept, now = random.Random(3), window_settings(None), KeptReads(3600.0), 1000.0
    n = _write(store, rng, 0, now)
    with transaction(store) as s:
        _both(s, settings, kept, now)
        _both(s, settings, kept, now - 1.0)  # back: what it charged reaches past the window's end
        assert kept.evidence_window.counts.whole == 2
        rows = kept.evidence(s, settings, now - 90.0, now)  # longer: before what it retired
        assert kept.evidence_window.counts.whole == 3 and isinstance(rows, EvidenceRows)
        _both(s, settings, kept, now)  # shorter again: served from what it holds
        assert kept.evidence_window.counts.whole == 3
    _write(store, rng, n, now)


def test_a_record_deleted_in_the_window_leaves_at_the_next_whole_read(store: sessionmaker[Session]) -> None:
    rng, settings, kept, now = random.Random(4), window_settings(None), KeptReads(10.0), 1000.0
    n = _write(store, rng, _write(store, rng, 0, now), now)
    with transaction(store) as s:
        _both(s, settings, kept, now)
    with transaction(store) as s:
        s.execute(delete(RequestRecord).where(RequestRecord.id == rng.randint(1, n // 2)))
    with transaction(store) as s:
        _both(s, settings, kept, now + 11.0)  # the whole read is due
    assert kept.evidence_window.counts.whole == 2
