"""What the controller believes: refused (4xx) requests are charged to nobody; with
``controller.trusted_span_senders`` only records from those senders count."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import generate_latest

from controller import observe as observe_mod
from controller.loop import Reconciler
from controller.metrics import make_registry
from controller.notify import NullNotifier
from controller.policy import AlertConfig
from controller.wiring import default_effects
from pdscope.config import Settings
from store import queries as q
from store.db import transaction
from store.models import RequestRecord
from tests.controller.conftest import World
from tests.controller.seed import Seeder, all_pairs

_n = iter(range(10**9))


def refused(
    ts: float,
    p: str,
    d: str,
    *,
    status: str,
    http_status: int | None,
    sender: str | None = None,
    handoff_s: float = 3.0,
) -> RequestRecord:
    """A request P prefilled and D then refused as invalid: the proxy waited ``handoff_s`` for D's
    answer, and the collector's forensics flagged it (P's lease expired while its blocks were pinned)."""
    p_done = ts + 0.3
    return RequestRecord(
        request_id=f"bad{next(_n)}",
        status=status,
        http_status=http_status,
        p_instance=p,
        d_instance=d,
        p_pool="prefill",
        d_pool="decode",
        proxy_in=ts,
        p_sent=ts + 0.001,
        p_done=p_done,
        d_sent=p_done + 0.001,
        first_token=p_done + handoff_s,
        done=p_done + handoff_s,
        e2e_s=handoff_s + 0.3,
        slo_met=False,
        lease_expiry_suspect=True,
        prompt_tokens=4000,
        kv_bytes=4_000_000,
        sender=sender,
    )


def _tick_with_refusals(world: World, status: str, http_status: int | None, ticks: int = 8) -> Any:
    out = None
    for _ in range(ticks):
        now = world.clock.advance(2.0)
        world.seeder.scrape(now - 0.5, prefill_0={"expired": 3.0}, prefill_1={"expired": 3.0})
        world.seeder.requests(now - 1.9, all_pairs())
        with transaction(world.factory) as s:
            s.add_all(
                [
                    refused(
                        now - 1.8 + i * 0.01, "prefill-0", "decode-1", status=status, http_status=http_status
                    )
                    for i in range(5)
                ]
            )
        out = world.reconciler.tick()
    return out


@pytest.mark.parametrize(
    "status,http_status", [("error", 400), ("client_error", 400), ("client_error", None), ("error", 422)]
)
def test_a_d_that_refused_invalid_requests_is_never_charged(
    world: World, status: str, http_status: int | None
) -> None:
    out = _tick_with_refusals(world, status, http_status)
    obs = world.reconciler.view().obs
    assert obs is not None
    d1 = obs.instance("decode-1")
    p0 = obs.instance("prefill-0")
    assert d1 is not None and p0 is not None
    assert d1.lease_expiry_suspects == 0 and d1.failed_requests == 0 and d1.refused_requests > 0
    assert p0.failed_requests == 0 and p0.refused_requests > 0
    assert d1.handoff_p99_s is not None and d1.handoff_p99_s < 1.0  # D's 3 s answers are no handoffs
    assert obs.slo.handoff_p99_s is not None and obs.slo.handoff_p99_s < 1.0
    assert world.weight("decode-1") == 1.0 and world.weight("prefill-0") == 1.0
    d = next(w for w in out.weights if w.instance == "decode-1")
    assert (
        d.reason != "LeaseExpiries"
        and d.inputs["refused_requests"] > 0
        and d.inputs["lease_expiry_suspects"] == 0
    )
    # the pool's in-flight estimate (admission) leaves them out too: only the charged records finish there
    with transaction(world.factory) as s:
        assert sum(h.lease_suspects for h in q.handoff_stats(s, 0, 1e12, by="d_instance").values()) > 0
        charged = q.handoff_stats(s, 0, 1e12, by="d_instance", only=q.RecordFilter(charged_only=True))
        assert sum(h.lease_suspects for h in charged.values()) == 0


def test_a_429_or_a_5xx_is_still_charged(world: World) -> None:
    _tick_with_refusals(world, "error", 503)
    obs = world.reconciler.view().obs
    assert obs is not None
    d1 = obs.instance("decode-1")
    assert (
        d1 is not None
        and d1.lease_expiry_suspects > 0
        and d1.failed_requests > 0
        and d1.refused_requests == 0
    )
    assert q.is_client_error("error", 429) is False and q.is_client_error("rejected", 429) is False
    assert q.is_client_error("error", 404) is True and q.is_client_error("ok", None) is False


# -- item 7: trusted senders --------------------------------------------------------------------


def _trusting(settings: Settings, senders: list[str] | None) -> Settings:
    return settings.model_copy(
        update={"controller": settings.controller.model_copy(update={"trusted_span_senders": senders})}
    )


def _forged_run(world: World, senders: list[str] | None, ticks: int = 10) -> Reconciler:
    """Good traffic from the proxy (sender "proxy"); forged slow handoffs through decode-2, unsigned and
    from an unknown token, flagged as lease-expiry suspects."""
    settings = _trusting(world.settings, senders)
    rec = Reconciler(
        settings,
        world.factory,
        effects=default_effects(settings, world.factory, clock=world.clock),
        clock=world.clock,
        alert_config=AlertConfig(for_s={}),
    )
    seeder = Seeder(world.factory, settings)
    for _ in range(ticks):
        now = world.clock.advance(2.0)
        seeder.scrape(now - 0.5)
        seeder.requests(now - 1.9, all_pairs(), sender="proxy")
        for forger in (None, "mallory"):
            seeder.requests(
                now - 1.8,
                [(p, "decode-2") for p in ("prefill-0", "prefill-1")] * 3,
                handoff_s={"decode-2": 1.5},
                suspect={"decode-2"},
                sender=forger,
            )
        rec.tick()
    return rec


def test_records_from_untrusted_senders_do_not_steer(world: World) -> None:
    rec = _forged_run(world, ["proxy"])
    served = {r.name: r.weight for r in rec.table.instances}
    assert served["decode-2"] == 1.0
    v = rec.view()
    assert v.obs is not None and v.last is not None
    assert v.obs.untrusted_records == 5 * 2 * 6  # the window (10 s) holds 5 ticks x 2 forgers x 6 records
    assert all(
        d.inputs["untrusted_records"] == v.obs.untrusted_records
        for d in v.last.weights
        if "requests" in d.inputs
    )
    assert all(p.inputs["untrusted_records"] == v.obs.untrusted_records for p in v.last.pools)
    text = generate_latest(make_registry(rec, NullNotifier())).decode()
    assert f"pdscope_controller_untrusted_records {float(v.obs.untrusted_records)}" in text


def test_without_a_trusted_list_every_record_counts(world: World) -> None:
    """The same forged records do move decode-2 when no list is configured (the default)."""
    rec = _forged_run(world, None)
    served = {r.name: r.weight for r in rec.table.instances}
    assert served["decode-2"] < 1.0
    v = rec.view()
    assert v.obs is not None and v.obs.untrusted_records == 0


def test_an_empty_trusted_list_believes_no_record(world: World) -> None:
    rec = _forged_run(world, [], ticks=3)
    v = rec.view()
    assert v.obs is not None
    assert all(i.requests == 0 for i in v.obs.instances) and v.obs.untrusted_records > 0
    assert observe_mod.trusted_filter(rec.settings).senders == frozenset()
