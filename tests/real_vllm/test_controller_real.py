"""The controller on a real CPU vLLM P/D pair: a real lease expiry raises ``KVLeaseExpired``.

The collector scrapes the real P and D into a store; the controller reconciles over that
store. A prefill whose decode never comes pins its KV blocks on P for the pair's short
lease; when the lease runs out P counts ``vllm:nixl_num_kv_expired_reqs_total``. The
controller sees the counter rise in its window and fires ``KVLeaseExpired`` for P, which writes
its incident bundle; once the window no longer holds the expiry the alert resolves.
"""

from __future__ import annotations

import json
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from sqlalchemy import select

from controller.bundlepack import alert_bundle_name
from controller.loop import Reconciler
from controller.policy import AlertConfig
from controller.replay import replay_window
from controller.wiring import default_effects
from pdscope.config import parse_config
from store.db import make_engine, session_factory, transaction
from store.migrate import upgrade
from store.models import Alert, Snapshot
from tests.real_vllm import pd_client as pc
from tests.real_vllm.conftest import RealPD
from tests.real_vllm.prompts import unique_prompt
from tests.support.collector import CollectorThread
from tests.support.waiting import wait_until

pytestmark = pytest.mark.real_vllm

WINDOW_S = 8


def tick_until(
    what: str, rec: Reconciler, pred: Callable[[Any], Any], within: float, every: float = 1.0
) -> Any:
    """Tick the reconciler until ``pred(outcome)`` is truthy; return that value."""
    return wait_until(what, lambda: pred(rec.tick()), timeout_s=within, every_s=every)


@pytest.fixture
def controlled(real_pd: RealPD, tmp_path: Path) -> Iterator[tuple[Reconciler, Any]]:
    url = f"sqlite:///{tmp_path / 'real.db'}"
    upgrade(url)
    cfg = real_pd.config_dict(
        store={"url": url},
        collector={"scrape_interval_s": 1.0, "scrape_timeout_s": 0.9},
        controller={
            "interval_s": 1.0,
            "window_s": WINDOW_S,
            "bundles": {"enabled": True, "dir": str(tmp_path / "bundles")},
        },
    )
    settings = parse_config(yaml.safe_dump(cfg), "real.yaml")
    engine = make_engine(url)
    factory = session_factory(engine)
    rec = Reconciler(
        settings,
        factory,
        effects=default_effects(settings, factory),
        alert_config=AlertConfig(for_s={"KVLeaseExpired": 0.0}),
    )
    with CollectorThread(settings):
        yield rec, factory
    rec.bundler.close()
    engine.dispose()


def _lease_alerts(out: Any) -> list[Any]:
    return [a for a in out.alerts.active if a.rule == "KVLeaseExpired"]


def test_real_lease_expiry_fires_and_resolves_kv_lease_expired(real_pd: RealPD, controlled: Any) -> None:
    rec, factory = controlled

    def scraped(out: Any) -> bool:
        with transaction(factory) as s:
            names = set(s.scalars(select(Snapshot.instance).where(Snapshot.up.is_(True))))
        return {real_pd.prefill_name, real_pd.decode_name} <= names

    tick_until("a stored snapshot of P and of D", rec, scraped, 30)
    # Earlier tests' expiries leave the window first. No condition marks that (one not yet scraped
    # shows no alert either), so the window's own length of real time passes, ticking each second.
    for _ in range(WINDOW_S + 2):
        out = rec.tick()
        time.sleep(1.0)
    assert not [a for a in _lease_alerts(out) if a.state == "firing"], "no expiry yet"

    with httpx.Client(timeout=60.0) as client:
        body = {"model": real_pd.model, "prompt": unique_prompt(50, "ctl-lease"), "max_tokens": 4}
        pr = pc.prefill(client, real_pd.prefill_url, "completions", body)
        assert pr.status == 200 and pr.kv_transfer_params, pr.body
    # Nobody decodes: after the lease P releases the blocks and counts the expiry.
    fired = tick_until(
        "KVLeaseExpired to fire",
        rec,
        lambda out: [a for a in _lease_alerts(out) if a.state == "firing"],
        real_pd.lease_s + 30,
    )
    alert = fired[0]
    assert alert.labels["instance"] == real_pd.prefill_name and alert.labels["role"] == "prefill"
    assert alert.value > 0 and "expired" in alert.description
    with transaction(factory) as s:
        row = s.scalars(select(Alert).where(Alert.rule == "KVLeaseExpired")).one()
        assert row.state == "firing" and row.fired_at is not None
    # ... and its incident bundle is written, in the background, with the window and the report in it
    assert rec.bundler.folder is not None and alert.fired_at is not None
    path = rec.bundler.folder / alert_bundle_name("KVLeaseExpired", alert.labels, alert.fired_at)
    wait_until(f"the alert's bundle {path.name}", path.is_file, timeout_s=60)
    with tarfile.open(path, "r:gz") as tar:
        got = {m.name.split("/", 1)[1]: m for m in tar.getmembers()}
        manifest = json.load(tar.extractfile(got["manifest.json"]))  # type: ignore[arg-type]
        report = tar.extractfile(got["report.html"]).read().decode()  # type: ignore[union-attr]
    assert {"records.jsonl", "snapshots.jsonl", "decisions.jsonl", "alerts.jsonl", "attribution.json"} <= set(
        got
    )
    assert (
        manifest["trigger"]["alertname"] == "KVLeaseExpired"
        and manifest["tables"]["snapshots"]["rows_included"]
    )
    assert "<b>KVLeaseExpired</b>" in report and "<svg" in report

    # The window slides past the expiry: the alert resolves and the resolution is stored.
    tick_until("KVLeaseExpired to resolve", rec, lambda out: not _lease_alerts(out), WINDOW_S + 20)
    with transaction(factory) as s:
        row = s.scalars(select(Alert).where(Alert.rule == "KVLeaseExpired")).one()
        assert (
            row.state == "resolved" and row.resolved_at is not None and row.resolved_at > (row.fired_at or 0)
        )
        # every tick of this run on real vLLM's figures replays exactly, the alert's life included
        replayed = replay_window(s, 0.0, time.time() + 1.0)
    assert replayed.reproduced is True, replayed.mismatches[:3]
    assert any(k.startswith("KVLeaseExpired{") for k in replayed.alerts), replayed.alerts
