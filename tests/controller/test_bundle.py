"""Incident bundles from a seeded store (SQLite and PostgreSQL): written when an alert fires, with the
window inside, bounded, atomic, never holding the loop; the webhook says where; the API serves them."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import httpx
import pytest
from fastapi.testclient import TestClient

import controller.bundle as bundle_mod
from controller.api import create_app
from controller.bundle import (
    STALE_TEMP_S,
    BundleWriter,
    NullBundler,
    list_bundles,
    make_bundler,
    write_bundle,
)
from controller.bundlepack import stamp
from controller.loop import Reconciler
from controller.notify import WebhookNotifier
from controller.policy import AlertConfig
from controller.policy.alerts import AlertState
from controller.wiring import default_effects
from tests.controller.conftest import World

URL_BASE = "http://ctl:8300/v1/bundles"
EXPECTED = {
    "manifest.json",
    "report.html",
    "attribution.json",
    "settings.json",
    "policy_configs.json",
    "alerts.jsonl",
    "decisions.jsonl",
    "overrides.jsonl",
    "records.jsonl",
    "snapshots.jsonl",
}


@dataclasses.dataclass
class Bundled:
    world: World
    writer: BundleWriter
    folder: Path


def _with_bundles(world: World, folder: Path, **cfg: Any) -> Any:
    c = world.settings.controller
    b = c.bundles.model_copy(update={"enabled": True, "dir": str(folder), **cfg})
    return world.settings.model_copy(update={"controller": c.model_copy(update={"bundles": b})})


def _bundled(world: World, folder: Path, **cfg: Any) -> Bundled:
    settings = _with_bundles(world, folder, **cfg)
    writer = BundleWriter(settings, world.factory, clock=world.clock, url_base=URL_BASE)
    rec = Reconciler(
        settings,
        world.factory,
        effects=default_effects(
            settings, world.factory, clock=world.clock, notifier=world.notifier, bundler=writer
        ),
        clock=world.clock,
        alert_config=AlertConfig(for_s={"KVLeaseExpired": 0.0, "InstanceDown": 4.0}),
    )
    return Bundled(dataclasses.replace(world, settings=settings, reconciler=rec), writer, folder)


@pytest.fixture
def bundled(world: World, tmp_path: Path) -> Iterator[Bundled]:
    b = _bundled(world, tmp_path / "bundles")
    yield b
    b.writer.close()


def fire_lease_alert(w: World) -> Any:
    for _ in range(3):
        w.step()
    out = w.step(scrape={"prefill_1": {"expired": 2.0}})
    (st,) = [a for a in out.alerts.changed if a.rule == "KVLeaseExpired" and a.state == "firing"]
    return st


def members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path, "r:gz") as tar:
        out = {}
        for m in tar.getmembers():
            f = tar.extractfile(m)
            assert f is not None
            out[m.name] = f.read()
        return out


def jsonl(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.splitlines()]


def state(rule: str = "KVLeaseExpired", fired_at: float = 1_800_000_100.0, **kw: Any) -> AlertState:
    base: dict[str, Any] = dict(
        rule=rule,
        fingerprint=f"fp-{rule}-{fired_at}",
        labels={"instance": "prefill-0"},
        severity="warning",
        state="firing",
        value=1.0,
        description="d",
        summary="s",
        active_since=fired_at,
        last_eval=fired_at,
        fired_at=fired_at,
    )
    base.update(kw)
    return AlertState(**base)


def test_a_firing_alert_writes_its_bundle_with_the_window_in_it(bundled: Bundled) -> None:
    w = bundled.world
    st = fire_lease_alert(w)
    assert bundled.writer.wait_idle(30), "the bundle was not written"
    assert (bundled.writer.written, bundled.writer.failed) == (1, 0)
    name = f"pdscope-KVLeaseExpired-prefill-1-{stamp(st.fired_at)}.tar.gz"
    files = [p.name for p in bundled.folder.iterdir()]
    assert files == [name], files  # and no temporary file beside it
    got = members(bundled.folder / name)
    folder = name.removesuffix(".tar.gz")
    assert {n.split("/", 1)[1] for n in got} == EXPECTED and all(n.startswith(folder + "/") for n in got)
    man = json.loads(got[f"{folder}/manifest.json"])
    assert (
        man["trigger"]["alertname"] == "KVLeaseExpired"
        and man["trigger"]["labels"]["instance"] == "prefill-1"
    )
    assert man["window"]["until"] == st.fired_at and man["window"]["from"] == st.fired_at - 900
    assert man["truncated"] is False
    # the window's rows: 4 steps x 8 pairs, 4 scrapes x 6 instances
    records = jsonl(got[f"{folder}/records.jsonl"])
    snaps = jsonl(got[f"{folder}/snapshots.jsonl"])
    assert len(records) == 32 and len(snaps) == 24 and man["tables"]["records"]["rows_in_window"] == 32
    assert [r["proxy_in"] for r in records] == sorted(r["proxy_in"] for r in records)
    alerts = jsonl(got[f"{folder}/alerts.jsonl"])
    assert any(a["rule"] == "KVLeaseExpired" and a["state"] == "firing" for a in alerts)
    policies = json.loads(got[f"{folder}/policy_configs.json"])
    assert [p["fingerprint"] for p in policies] == [w.reconciler.policy] == man["policy_configs"]
    settings = json.loads(got[f"{folder}/settings.json"])
    assert (
        settings["controller"]["bundles"]["enabled"] is True and settings["slo"]["ttft"]["target_ms"] == 2000
    )
    attribution = json.loads(got[f"{folder}/attribution.json"])
    assert attribution["requests"] == 32
    page = got[f"{folder}/report.html"].decode()
    assert "<b>KVLeaseExpired</b>" in page and "<svg" in page and "TTFT over time" in page


def test_the_webhook_says_where_the_bundle_is(bundled: Bundled) -> None:
    posted: list[dict[str, Any]] = []

    def hook(request: httpx.Request) -> httpx.Response:
        posted.append(json.loads(request.content))
        return httpx.Response(200)

    n = WebhookNotifier(
        "http://hook/alerts",
        "http://ctl:8300",
        transport=httpx.MockTransport(hook),
        annotate=bundled.writer.annotations,
    )
    st = fire_lease_alert(bundled.world)
    batch = [a for b in bundled.world.notifier.batches for a in b if a.fingerprint == st.fingerprint]
    n.send(batch)
    n.close()
    (payload,) = posted
    ann = payload["alerts"][0]["annotations"]
    name = ann["bundle_name"]
    assert name.startswith("pdscope-KVLeaseExpired-prefill-1-") and name.endswith("Z.tar.gz")
    assert ann["bundle"] == str(bundled.folder.resolve() / name)
    assert ann["bundle_url"] == f"{URL_BASE}/{name}"
    assert ann["summary"] and ann["description"]  # the alert's own annotations stay
    assert bundled.writer.wait_idle(30) and Path(ann["bundle"]).is_file()
    other = state("InstanceDown", fingerprint="not-bundled")
    assert bundled.writer.annotations(other) == {}


def test_rows_past_max_records_are_sampled_and_the_manifest_says_so(world: World, tmp_path: Path) -> None:
    for _ in range(4):
        world.step()
    settings = _with_bundles(world, tmp_path, max_records=5)
    hi = world.clock()
    w = write_bundle(
        world.factory, settings, hi - 900, hi, tmp_path / "out", name="pdscope-range-test.tar.gz"
    )
    got = members(w.path)
    records = jsonl(got["pdscope-range-test/records.jsonl"])
    entry = w.manifest["tables"]["records"]
    assert (
        entry["rows_in_window"] == 32
        and entry["sampled_every"] == 7
        and len(records) == entry["rows_read"] <= 5
    )
    assert len({r["id"] % 7 for r in records}) == 1, "1 row in every 7, by id"
    assert w.manifest["truncated"] is True
    assert any(n.startswith("records: 32 rows in the window, over max_records") for n in w.manifest["notes"])
    assert "over max_records: 1 row in every 7 was kept" in got["pdscope-range-test/report.html"].decode()


def test_a_full_disk_fails_the_bundle_leaves_nothing_and_is_counted(
    bundled: Bundled, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fileobj: IO[bytes], members: Any, mtime: float) -> None:
        fileobj.write(b"\x1f\x8b partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(bundle_mod, "_write_tar", full)
    st = fire_lease_alert(bundled.world)
    assert bundled.writer.wait_idle(30)
    assert (bundled.writer.written, bundled.writer.failed) == (0, 1)
    assert list(bundled.folder.iterdir()) == [], "no archive and no temporary file left"
    assert "no space left on the device" in (bundled.writer.last_error or "")
    assert str(bundled.folder.resolve()) in (bundled.writer.last_error or "")
    assert "failed" in bundled.writer.annotations(st)["bundle_error"]
    app = create_app(bundled.world.reconciler, token="t0ken", notifier=bundled.world.notifier)
    with TestClient(app) as client:
        health = client.get("/healthz").json()
        metrics = client.get("/metrics").text
    assert health["bundles"]["failed"] == 1 and health["bundles"]["written"] == 0
    assert "no space left" in health["bundles"]["last_error"]
    assert "pdscope_bundles_failed_total 1.0" in metrics and "pdscope_bundles_written_total 0.0" in metrics


def test_the_loop_is_never_held_and_the_queue_is_bounded(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started, release = threading.Event(), threading.Event()
    real = bundle_mod.write_bundle

    def slow(*args: Any, **kw: Any) -> Any:
        started.set()
        release.wait(30)  # a guard against a hang, not a bound
        return real(*args, **kw)

    monkeypatch.setattr(bundle_mod, "write_bundle", slow)
    b = _bundled(world, tmp_path / "bundles", queue_max=2)
    try:
        fire_lease_alert(b.world)  # the tick that queued the bundle has returned ...
        assert started.wait(30) and not release.is_set()  # ... while its bundle is still being written
        b.world.step()  # and the next tick runs too
        assert b.writer.pending == 1
        b.writer.alerts_changed([state(fired_at=1_800_000_100.0 + k) for k in range(3)])
        assert b.writer.dropped == 1 and b.writer.pending == 3  # 2 queued (the oldest dropped) + 1 in flight
        release.set()
        assert b.writer.wait_idle(30)
        assert (b.writer.written, b.writer.failed, b.writer.dropped) == (3, 0, 1)
        assert len(list_bundles(b.folder)) == 3
    finally:
        release.set()
        b.writer.close()


def test_only_the_configured_rules_and_only_a_start_of_firing_write(world: World, tmp_path: Path) -> None:
    b = _bundled(world, tmp_path / "bundles", rules=["InstanceDown"])
    try:
        fire_lease_alert(b.world)
        b.writer.alerts_changed(
            [state("InstanceDown", state="pending", fired_at=None), state("InstanceDown", state="resolved")]
        )
        assert b.writer.wait_idle(30) and b.writer.written == 0 and list(b.folder.glob("*")) == []
        b.writer.alerts_changed([state("InstanceDown")])
        assert b.writer.wait_idle(30) and b.writer.written == 1
    finally:
        b.writer.close()


def test_only_the_newest_automatic_bundles_are_kept(world: World, tmp_path: Path) -> None:
    folder = tmp_path / "bundles"
    folder.mkdir()
    (folder / "pdscope-range-20270101T000000Z-20270101T001500Z.tar.gz").write_bytes(b"on demand")
    stale, fresh = folder / ".pdscope-x.tar.gz.abc.tmp", folder / ".pdscope-y.tar.gz.def.tmp"
    stale.write_bytes(b"left by a crash")
    fresh.write_bytes(b"being written")
    old = time.time() - 2 * STALE_TEMP_S  # file times are real ones
    os.utime(stale, (old, old))
    for _ in range(2):
        world.step()
    b = _bundled(world, folder, keep=2)
    try:
        for k in range(4):
            b.writer.alerts_changed([state(fired_at=1_800_000_000.0 + 60 * k)])
            assert b.writer.wait_idle(30)
    finally:
        b.writer.close()
    names = sorted(p.name for p in folder.iterdir())
    assert names == [
        ".pdscope-y.tar.gz.def.tmp",
        "pdscope-KVLeaseExpired-prefill-0-20270115T080200Z.tar.gz",
        "pdscope-KVLeaseExpired-prefill-0-20270115T080300Z.tar.gz",
        "pdscope-range-20270101T000000Z-20270101T001500Z.tar.gz",
    ]


def test_the_api_lists_and_serves_the_bundles(bundled: Bundled) -> None:
    fire_lease_alert(bundled.world)
    assert bundled.writer.wait_idle(30)
    app = create_app(bundled.world.reconciler, token="t0ken", notifier=bundled.world.notifier)
    with TestClient(app) as client:
        listing = client.get("/v1/bundles").json()
        assert listing["enabled"] is True and listing["dir"] == str(bundled.folder.resolve())
        (one,) = listing["bundles"]
        path = bundled.folder / one["name"]
        assert one["bytes"] == path.stat().st_size and one["url"].endswith(f"/v1/bundles/{one['name']}")
        got = client.get(f"/v1/bundles/{one['name']}")
        assert got.status_code == 200 and got.content == path.read_bytes()
        assert got.headers["content-type"] == "application/gzip"
        for bad in ("pdscope-nope.tar.gz", "..%2F..%2Fetc%2Fpasswd", ".pdscope-x.tar.gz.tmp", "store.db"):
            r = client.get(f"/v1/bundles/{bad}")
            assert r.status_code == 404, (bad, r.status_code)


def test_make_bundler_follows_enabled(world: World, tmp_path: Path) -> None:
    assert isinstance(make_bundler(world.settings, world.factory), NullBundler)
    assert world.reconciler.bundler.folder is None  # off by default: the controller writes nothing
    on = make_bundler(_with_bundles(world, tmp_path), world.factory)
    try:
        assert isinstance(on, BundleWriter) and on.folder == tmp_path.resolve()
    finally:
        on.close()
    app = create_app(world.reconciler, token="t0ken", notifier=world.notifier)
    with TestClient(app) as client:
        assert client.get("/healthz").json()["bundles"] == {
            "enabled": False,
            "written": 0,
            "failed": 0,
            "dropped": 0,
            "pending": 0,
            "last_error": None,
        }
        assert client.get("/v1/bundles").json()["bundles"] == []


def test_a_bundle_is_never_partial_when_it_replaces_one(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure while rewriting a bundle of the same name keeps the earlier whole one."""
    world.step()
    folder = tmp_path / "out"
    settings = _with_bundles(world, folder)
    hi = world.clock()
    first = write_bundle(world.factory, settings, hi - 60, hi, folder, name="pdscope-range-x.tar.gz")
    before = first.path.read_bytes()

    def broken(fileobj: IO[bytes], members: Any, mtime: float) -> None:
        fileobj.write(b"half")
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(bundle_mod, "_write_tar", broken)
    with pytest.raises(bundle_mod.BundleWriteError, match=f"cannot write a bundle in {folder}: I/O error"):
        write_bundle(world.factory, settings, hi - 60, hi, folder, name="pdscope-range-x.tar.gz")
    assert [p.name for p in folder.iterdir()] == ["pdscope-range-x.tar.gz"]
    assert first.path.read_bytes() == before


def test_a_window_that_straddles_a_config_change_holds_both_configs_and_says_so(
    world: World, tmp_path: Path
) -> None:
    for _ in range(3):
        world.step(prefill_s={"prefill-1": 2.5})
    c = world.settings.controller
    changed = world.settings.model_copy(update={"controller": c.model_copy(update={"max_weight_step": 0.5})})
    rec = Reconciler(
        changed,
        world.factory,
        effects=default_effects(changed, world.factory, clock=world.clock, notifier=world.notifier),
        clock=world.clock,
    )
    w2 = dataclasses.replace(world, settings=changed, reconciler=rec)
    for _ in range(3):
        w2.step(prefill_s={"prefill-1": 2.5})
    assert rec.policy != world.reconciler.policy
    hi = world.clock()
    w = write_bundle(world.factory, changed, hi - 900, hi, tmp_path / "out", name="pdscope-range-cfg.tar.gz")
    got = members(w.path)
    policies = {p["fingerprint"] for p in json.loads(got["pdscope-range-cfg/policy_configs.json"])}
    decided = {d["policy"] for d in jsonl(got["pdscope-range-cfg/decisions.jsonl"])}
    assert policies == decided == {world.reconciler.policy, rec.policy}
    assert any(n.startswith("the policy config changed in the window") for n in w.manifest["notes"])
