"""The tenants' records kept between ticks (controller.tenantrows, KeptReads.tenants) equal a whole read.

Pure: seeded histories of records inserted, changed (a late span, a sender no longer believed) and aged
out, under a limit, against the newest-first selection made from scratch; the kept tally's figures
against ``tenant_window`` over that selection, to the bit, and again after the tenants' terms change.
On a store (SQLite and PostgreSQL): ticks that read only the changed records give
``store.tenants.tenant_rows``' rows, in its order, and the same tenant figures, tick by tick.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from analysis.tenants import TenantFacts, TenantTerms, tenant_window, terms_of
from controller.kept import KeptReads
from controller.tenantrows import TenantRows
from controller.tenants import read_tenants, tenant_figures
from pdscope.tenantcost import Costs
from store.attribution import trusted_records
from store.db import transaction
from store.tenants import tenant_rows
from store.window import WindowRows
from tests.controller.test_slowindow import store_tick, window_settings

TENANTS = ("chat", "batch", "undeclared", None)
SENDERS = ("proxy-a", "proxy-b", None)


def _facts(rng: random.Random, now: float) -> tuple[Any, ...]:
    """One record's tenant columns (store.tenants.TENANT_COLUMNS' order), some ahead of the clock."""
    at = round(now - rng.uniform(-3.0, 45.0), rng.choice([1, 6]))  # ties on proxy_in too
    return (
        rng.choice(TENANTS),
        rng.choice(["ok", "ok", "rejected", "error"]),
        rng.choice([None, "tenant_rate"]),
        at,
        at + 0.01,
        rng.uniform(0.05, 2.0),
        rng.uniform(0.01, 0.1),
        rng.randint(1, 4000),
        rng.randint(1, 500),
    )


def _scratch(rows: dict[int, tuple[Any, ...]], lo: float, hi: float, senders: Any, limit: int) -> WindowRows:
    """The newest-first selection of the believed rows of [lo, hi], as store.window.window_rows makes it."""
    inside = sorted(
        ((r[5], rid) for rid, r in rows.items() if lo <= r[5] <= hi and (senders is None or r[1] in senders)),
        reverse=True,
    )
    got = [rows[rid][2:] for _, rid in inside[: limit + 1]]
    return WindowRows(tuple(got[:limit]), len(got) > limit)


def _terms(seed: int) -> dict[str, TenantTerms]:
    chat: dict[str, Any] = {"weight": 2}
    if seed % 3 == 0:  # a tighter target for chat: more of its requests miss
        chat["slo"] = {"ttft_ms": 300}
    s = window_settings(None, tenants={"enabled": True, "tenants": {"chat": chat, "batch": {"weight": 1}}})
    return terms_of(s.tenants, s.slo)


@pytest.mark.parametrize("seed", range(12))
def test_kept_rows_equal_the_newest_first_selection_made_from_scratch(seed: int) -> None:
    rng, span = random.Random(seed), 30.0
    limit = 7 + seed % 5 if seed < 4 else 10**6  # truncated, or the tally's own figures
    senders = None if seed % 2 else frozenset({"proxy-a"})
    kept, truth, now = TenantRows(span, senders, limit), {}, 1000.0
    for _ in range(40):
        changed = []
        for _ in range(rng.randint(0, 9)):
            rid = (
                rng.choice(list(truth))
                if truth and rng.random() < 0.4
                else len(truth) + rng.randint(1, 10**6)
            )
            old = truth.get(rid)
            facts = _facts(rng, now)
            if old is not None:  # a late span: the arrival time stays
                facts = (*facts[:3], old[5], *facts[4:])
            truth[rid] = (rid, rng.choice(SENDERS), *facts)
            changed.append(truth[rid])
        kept.update(changed)
        now += rng.choice([0.0, 0.5, 2.0, 7.0])
        kept.slide(now - span)
        want = _scratch(truth, now - span, now, senders, limit)
        assert kept.read(now - span, now) == want
        terms = _terms(seed + len(truth) // 60)  # changes now and then: the tally is built again
        facts = [TenantFacts(*r) for r in want.rows]
        figures = tenant_window(facts, terms, since=now - span, until=now, costs=Costs(decode=0.5))
        assert kept.window(now - span, now, terms, Costs(decode=0.5)) == (figures, want.truncated)
        believed = [r for r in truth.values() if r[5] >= now - span and (senders is None or r[1] in senders)]
        assert len(kept) == len(believed)  # what it holds: the window's believed rows, no more


def _settings(trusted: list[str] | None) -> Any:
    return window_settings(
        trusted, tenants={"enabled": True, "tenants": {"chat": {"weight": 2}, "batch": {"weight": 1}}}
    )


def _values(rng: random.Random, now: float) -> dict[str, Any]:
    tenant, status, reason, at, sent, ttft, tpot, prompt, completion = _facts(rng, now)
    return {
        "tenant": tenant or "default",
        "status": status,
        "attributes": {} if reason is None else {"reject_reason": reason},
        "proxy_in": at,
        "p_sent": sent,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "sender": rng.choice(SENDERS),
    }


@pytest.mark.parametrize(("trusted", "limit"), [(None, 25), (["proxy-a"], 25), (["proxy-a"], 10**5)])
def test_ticks_that_read_only_changes_give_the_whole_reads_rows_and_figures(
    store_factory: sessionmaker[Session], trusted: list[str] | None, limit: int
) -> None:
    store = store_factory
    rng, settings_, kept, now, n = random.Random(9), _settings(trusted), KeptReads(3600.0), 1000.0, 0
    only = trusted_records(trusted)
    for tick in range(30):
        n = store_tick(store, rng, n, now, _values)
        now += rng.choice([0.5, 2.0, 2.0, 5.0])
        with transaction(store) as s:
            got = kept.tenants(s, settings_, now, limit)
            want = tenant_rows(s, now - 30.0, now, only=only, limit=limit)
            assert got == want, tick
            whole = read_tenants(s, settings_, now - 30.0, now, limit=limit)
            assert tenant_figures(got, settings_, now - 30.0, now, limit) == whole, tick
            assert kept.tenant_figures(s, settings_, now, limit) == whole, tick
    assert (
        kept.tenant_window.counts.whole == 1
        and kept.tenant_window.counts.changes == 59
        and kept.slo_window.counts.whole == 0
    )
    with transaction(store) as s:  # a clock that went back reaches before what was retired: read whole
        assert kept.tenants(s, settings_, now - 1.0, limit) == tenant_rows(
            s, now - 31.0, now - 1.0, only=only, limit=limit
        )
    assert kept.tenant_window.counts.whole == 2


def test_a_clock_that_jumps_past_a_whole_window_still_counts_the_row_at_its_start() -> None:
    rows, terms = TenantRows(30.0, None, 100), _terms(1)
    ahead = (1, "proxy-a", "chat", "ok", None, 40.0, 40.1, 0.2, 0.01, 100, 10)
    rows.update([ahead, (2, "proxy-a", "chat", "ok", None, 5.0, 5.1, 0.2, 0.01, 100, 10)])
    rows.slide(-20.0)
    first, _ = rows.window(-20.0, 10.0, terms, Costs())  # the row ahead of the clock waits
    assert (c := first.of("chat")) is not None and c.requests == 1
    rows.slide(40.0)  # 60 s later: the first row retired, the one at the window's very start due
    later, _ = rows.window(40.0, 70.0, terms, Costs())
    assert later == tenant_window([TenantFacts(*ahead[2:])], terms, since=40.0, until=70.0)
    assert (c := later.of("chat")) is not None and c.requests == 1
