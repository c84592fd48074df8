"""Parallel mutations of one subject against a served app (uvicorn, real sockets): serialised.

Runs on SQLite and (the ``pg`` tier) PostgreSQL through the ``store_url`` fixture.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from typing import Any

import httpx
from sqlalchemy import select

from controller.api import create_app
from controller.loop import Reconciler
from controller.persist import load_overrides
from controller.wiring import default_effects
from store.db import transaction
from store.models import AuditEvent, WeightOverride
from tests.controller.conftest import World
from tests.support.serving import serve

TOKEN = "t0ken"
N = 100


async def _storm(apps: list[Any], requests: list[tuple[str, str, dict[str, Any]]]) -> list[int]:
    """Serve each app on its own socket and send every request at once, spread over the apps."""
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve(app, stop_timeout_s=30)) for app in apps]
        limits = httpx.Limits(max_connections=N, max_keepalive_connections=N)
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(
                    base_url=url,
                    limits=limits,
                    timeout=httpx.Timeout(60.0),
                    headers={"Authorization": f"Bearer {TOKEN}"},
                )
            )
            for url in urls
        ]
        got = await asyncio.gather(
            *(
                clients[i % len(clients)].request(m, path, json=body)
                for i, (m, path, body) in enumerate(requests)
            )
        )
        return [r.status_code for r in got]


def _audit_chain(world: World, subject: str) -> list[AuditEvent]:
    with transaction(world.factory) as s:
        return list(
            s.scalars(select(AuditEvent).where(AuditEvent.subject == subject).order_by(AuditEvent.id))
        )


def test_parallel_puts_leave_one_override_and_an_unbroken_audit_chain(world: World) -> None:
    world.step()
    app = create_app(world.reconciler, token=TOKEN)
    # TTLs vary, so a replaced override outlives the winner unless it was really cleared
    puts = [
        (
            "PUT",
            "/v1/instances/decode-1/weight",
            {"weight": round(0.01 * (i + 1), 2), "ttl_s": 10.0 + 50.0 * (i % 3), "reason": f"r{i}"},
        )
        for i in range(N)
    ]
    statuses = asyncio.run(_storm([app], puts))
    assert statuses == [200] * N

    with transaction(world.factory) as s:
        rows = list(
            s.scalars(
                select(WeightOverride).where(WeightOverride.subject == "decode-1").order_by(WeightOverride.id)
            )
        )
    assert len(rows) == N
    live = [r for r in rows if r.cleared is None]
    assert len(live) == 1, f"{len(live)} overrides left active"
    winner = live[0]
    assert winner.id == rows[-1].id  # the last one written wins

    chain = _audit_chain(world, "decode-1")
    assert len(chain) == N
    prev_override: int | None = None
    for ev in chain:
        assert ev.before is not None and ev.after is not None
        assert ev.before["override_id"] == prev_override, (
            "an audit event's 'before' is not the previous 'after'"
        )
        assert ev.after["override_id"] == ev.override_id
        prev_override = ev.override_id
    assert prev_override == winner.id
    served = next(i for i in world.reconciler.table.instances if i.name == "decode-1")
    assert served.weight == winner.weight

    # the winner expires: nothing it replaced comes back
    assert winner.expires is not None
    world.clock.now = winner.expires + 1.0
    with transaction(world.factory) as s:
        assert [o for o in load_overrides(s, world.clock()) if o.subject == "decode-1"] == []
    world.reconciler.refresh()
    served = next(i for i in world.reconciler.table.instances if i.name == "decode-1")
    assert served.weight == 1.0 and served.reason != "ManualOverride"


def test_parallel_drains_undrains_and_pool_overrides_stay_consistent(world: World) -> None:
    world.step()
    app = create_app(world.reconciler, token=TOKEN)
    mixed: list[tuple[str, str, dict[str, Any]]] = []
    for i in range(N // 2):
        mixed.append(("POST", "/v1/instances/decode-2/drain", {"reason": f"d{i}"}))
        mixed.append(("PUT", "/v1/pools/decode/weight", {"weight": 0.5, "ttl_s": 60.0, "reason": f"p{i}"}))
    statuses = asyncio.run(_storm([app], mixed))
    assert statuses == [200] * N
    with transaction(world.factory) as s:
        live = list(s.scalars(select(WeightOverride).where(WeightOverride.cleared.is_(None))))
    assert sorted((r.subject_kind, r.subject) for r in live) == [("instance", "decode-2"), ("pool", "decode")]
    for subject in ("decode-2", "decode"):
        prev: int | None = None
        for ev in _audit_chain(world, subject):
            assert ev.before is not None and ev.before["override_id"] == prev
            prev = ev.override_id


def test_two_controller_processes_on_one_store_are_serialised_by_the_store(world: World) -> None:
    """Two apps with their own reconcilers (as two processes would be): only the store's lock
    (BEGIN IMMEDIATE on SQLite, an advisory lock on PostgreSQL) keeps them from interleaving."""
    world.step()
    other = Reconciler(
        world.settings,
        world.factory,
        effects=default_effects(world.settings, world.factory, clock=world.clock),
        clock=world.clock,
    )
    apps = [create_app(world.reconciler, token=TOKEN), create_app(other, token=TOKEN)]
    puts = [
        ("PUT", "/v1/instances/decode-3/weight", {"weight": 0.5, "ttl_s": 30.0 + i, "reason": f"r{i}"})
        for i in range(N)
    ]
    assert asyncio.run(_storm(apps, puts)) == [200] * N
    with transaction(world.factory) as s:
        live = list(s.scalars(select(WeightOverride).where(WeightOverride.cleared.is_(None))))
    assert len(live) == 1
    prev: int | None = None
    for ev in _audit_chain(world, "decode-3"):
        assert ev.before is not None and ev.before["override_id"] == prev
        prev = ev.override_id
    assert prev == live[0].id
