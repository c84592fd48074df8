"""The control API's boundaries: wrong tokens throttled by address, reasons and actor names with
visible text only, bundles served only as regular files in their folder, request headers within
controller.header_timeout_s (the process)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from controller.api import create_app
from controller.bundle import BundleRefused, open_bundle
from controller.loop import Reconciler
from controller.wiring import default_effects
from store.db import transaction
from store.models import AuditEvent, WeightOverride
from tests.controller.conftest import World
from tests.support.sockets import free_port
from tests.support.waiting import wait_until

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BODY = {"weight": 0.5, "ttl_s": 60, "reason": "x"}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def client(world: World) -> Iterator[TestClient]:
    world.step()
    with TestClient(create_app(world.reconciler, token=TOKEN), raise_server_exceptions=False) as c:
        yield c


def written(world: World) -> tuple[int, int]:
    with transaction(world.factory) as s:
        return (
            s.scalar(select(func.count()).select_from(WeightOverride)) or 0,
            s.scalar(select(func.count()).select_from(AuditEvent)) or 0,
        )


# -- wrong tokens ----------------------------------------------------------------------------------


def test_wrong_tokens_are_throttled_by_address_counted_and_logged_once(
    client: TestClient, world: World, caplog: pytest.LogCaptureFixture
) -> None:
    limit = world.settings.controller.auth_throttle.max_failures
    caplog.set_level(logging.WARNING, logger="pdscope.auththrottle")
    for _ in range(limit + 1):  # the last one is past the limit
        r = client.put("/v1/instances/decode-1/weight", json=BODY, headers={"Authorization": "Bearer guess"})
        assert r.status_code == 401
    r = client.put("/v1/instances/decode-1/weight", json=BODY, headers=AUTH)  # the right token, unread
    assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 300, r.text
    r = client.get("/v1/whoami", headers=AUTH)  # the same throttle: no guessing through whoami
    assert r.status_code == 429 and "retry-after" in r.headers
    assert written(world) == (0, 0)
    metrics = client.get("/metrics").text
    assert f'pdscope_controller_auth_failures_total{{reason="invalid"}} {limit + 1}.0' in metrics
    assert 'pdscope_controller_auth_failures_total{reason="throttled"} 2.0' in metrics
    lines = [r.getMessage() for r in caplog.records if r.name == "pdscope.auththrottle"]
    assert len(lines) == 2 and "testclient" in lines[0] and "wrong tokens" in lines[1], lines


def test_wrong_tokens_through_whoami_count_towards_the_block(client: TestClient, world: World) -> None:
    limit = world.settings.controller.auth_throttle.max_failures
    for _ in range(limit + 1):
        assert client.get("/v1/whoami", headers={"Authorization": "Bearer guess"}).status_code == 401
    r = client.put("/v1/instances/decode-1/weight", json=BODY, headers=AUTH)
    assert r.status_code == 429


def test_missing_tokens_are_counted_but_never_throttled(client: TestClient, world: World) -> None:
    limit = world.settings.controller.auth_throttle.max_failures
    for _ in range(limit + 5):
        assert client.put("/v1/instances/decode-1/weight", json=BODY).status_code == 401
    assert client.put("/v1/instances/decode-1/weight", json=BODY, headers=AUTH).status_code == 200
    metrics = client.get("/metrics").text
    assert f'pdscope_controller_auth_failures_total{{reason="missing"}} {limit + 5}.0' in metrics


# -- reasons and actor names -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "reason",
    [
        "\u200b",
        "\u200e",
        "\u202e",
        "\u2060",
        "\ufeff",
        "\u180e",
        "\u3164",
        "\u115f",
        "\u2800",
        "\u0301\u0301",
        " \u200b\u3164\u2800 ",
        "ok\u202eevil",
    ],
)
def test_a_reason_without_visible_text_is_422_naming_it(
    client: TestClient, world: World, reason: str
) -> None:
    r = client.put("/v1/instances/decode-1/weight", json={**BODY, "reason": reason}, headers=AUTH)
    assert r.status_code == 422 and {p["field"] for p in r.json()["detail"]} == {"reason"}, r.text
    r = client.post("/v1/instances/decode-1/drain", json={"reason": reason}, headers=AUTH)
    assert r.status_code == 422 and {p["field"] for p in r.json()["detail"]} == {"reason"}, r.text
    assert written(world) == (0, 0)


def test_a_reason_is_stored_nfc(client: TestClient) -> None:
    r = client.put(
        "/v1/instances/decode-1/weight", json={**BODY, "reason": "Jose\u0301 \U0001f6a7"}, headers=AUTH
    )
    assert r.status_code == 200 and r.json()["override"]["reason"] == "Jos\u00e9 \U0001f6a7"


@pytest.mark.parametrize("actor", ["\u3164", "\u0301\u0301", "\u2800", "\u115f\u200b", "\u202e\u2060"])
def test_an_invisible_x_actor_is_replaced_by_the_identity(client: TestClient, actor: str) -> None:
    r = client.put(
        "/v1/instances/decode-1/weight", json=BODY, headers={**AUTH, "X-Actor": actor.encode("utf-8")}
    )
    assert r.status_code == 200 and r.json()["override"]["actor"] == "api", r.text


# -- bundles ---------------------------------------------------------------------------------------


@pytest.fixture
def bundle_folder(world: World, tmp_path: Path) -> tuple[TestClient, Path, Path]:
    folder = tmp_path / "bundles"
    folder.mkdir()
    c = world.settings.controller
    settings = world.settings.model_copy(
        update={
            "controller": c.model_copy(update={"bundles": c.bundles.model_copy(update={"dir": str(folder)})})
        }
    )
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"not a bundle")
    rec = Reconciler(
        settings,
        world.factory,
        effects=default_effects(settings, world.factory, clock=world.clock, notifier=world.notifier),
        clock=world.clock,
    )
    return TestClient(create_app(rec, token=TOKEN), raise_server_exceptions=False), folder, secret


def test_bundles_serve_no_symlink_and_nothing_outside_their_folder(
    bundle_folder: tuple[TestClient, Path, Path],
) -> None:
    client, folder, secret = bundle_folder
    (folder / "pdscope-real-1.tar.gz").write_bytes(b"\x1f\x8bbundle")
    (folder / "pdscope-out-1.tar.gz").symlink_to(secret)  # points outside
    (folder / "pdscope-in-1.tar.gz").symlink_to(folder / "pdscope-real-1.tar.gz")  # points inside
    (folder / "pdscope-dir-1.tar.gz").mkdir()
    os.mkfifo(folder / "pdscope-fifo-1.tar.gz")
    with client:
        r = client.get("/v1/bundles/pdscope-real-1.tar.gz")
        assert r.status_code == 200 and r.content == b"\x1f\x8bbundle"
        assert r.headers["content-type"] == "application/gzip"
        assert r.headers["content-disposition"] == 'attachment; filename="pdscope-real-1.tar.gz"'
        for name in (
            "pdscope-out-1.tar.gz",
            "pdscope-in-1.tar.gz",
            "pdscope-dir-1.tar.gz",
            "pdscope-fifo-1.tar.gz",
            "..%2Fsecret.txt",
            "%2Ftmp%2Fpdscope-x.tar.gz",
            "pdscope-..%2F..%2Fsecret.tar.gz",
        ):
            r = client.get(f"/v1/bundles/{name}")
            assert r.status_code == 404 and b"not a bundle" not in r.content, (name, r.status_code)
        metrics = client.get("/metrics").text
    assert 'pdscope_controller_bundle_refusals_total{reason="symlink"} 2.0' in metrics
    assert 'pdscope_controller_bundle_refusals_total{reason="not_a_file"} 2.0' in metrics


def test_open_bundle_refuses_by_reason(tmp_path: Path) -> None:
    outside = tmp_path / "x.txt"
    outside.write_text("x")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "pdscope-l.tar.gz").symlink_to(outside)
    for name, reason in (
        ("pdscope-l.tar.gz", "symlink"),
        ("pdscope-none.tar.gz", "missing"),
        ("../x.txt", "bad_name"),
        (str(outside), "bad_name"),
        ("pdscope-a/../../x.tar.gz", "bad_name"),
    ):
        with pytest.raises(BundleRefused) as info:
            open_bundle(tmp_path / "b", name)
        assert info.value.reason == reason, name


# -- the process -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_pdscope_control_closes_a_partial_request_within_header_timeout_s(tmp_path: Path) -> None:
    port = free_port()
    cfg = tmp_path / "pdscope.yaml"
    cfg.write_text(f"""
model: {{name: m, kv_bytes_per_token: 1}}
pools:
  prefill: {{role: prefill, instances: [{{name: p0, url: "http://127.0.0.1:9"}}]}}
  decode: {{role: decode, instances: [{{name: d0, url: "http://127.0.0.1:9"}}]}}
store: {{url: "sqlite:///{tmp_path / "s.db"}"}}
controller: {{port: {port}, interval_s: 5, header_timeout_s: 0.5}}
""")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdscope.cli", "--config", str(cfg), "control"],
        cwd=REPO,
        env={**os.environ, "PDSCOPE_API_TOKEN": "tok"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(
            "the controller",
            lambda: httpx.get(f"{base}/healthz", timeout=1),
            ignore=(httpx.HTTPError,),
            timeout_s=60,  # a process start: slow on a loaded 2-core machine
        )
        with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
            s.sendall(b"PUT /v1/instances/d0/weight HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok\r\n")
            try:
                assert s.recv(4096) == b""  # closed by the server; a timeout means it held it open
            except TimeoutError:
                pytest.fail("the controller held a connection with unfinished headers open")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
