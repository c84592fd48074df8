"""The dashboard's API client against the real controller app (in-process), so the
forms' requests stay in step with the controller's schemas; then the dashboard's own
queries read the overrides and audit events the controller wrote."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from controller.api import create_app
from controller.loop import Reconciler
from controller.wiring import default_effects
from dashboard.api import ControllerClient, ControllerError
from dashboard.queries import control, fleet
from dashboard.queries.common import Window
from pdscope.config import load_config
from store.db import make_engine, session_factory

from .conftest import TOKEN, USER_TOKEN, make_seeded


def test_every_form_action_is_accepted_and_audited(tmp_path: Path) -> None:
    """Header mode's calls: the server token on behalf of the proxy's user (X-Actor)."""
    seeded = make_seeded(tmp_path, duration_s=300.0)
    engine = make_engine(seeded.url)
    settings, factory = load_config(seeded.config), session_factory(engine)
    reconciler = Reconciler(settings, factory, effects=default_effects(settings, factory))
    with TestClient(create_app(reconciler, token=TOKEN)) as tc:
        client = ControllerClient("http://testserver", TOKEN, transport=tc._transport, actor="carol")
        assert client.routing()["version"] >= 0
        weight = client.set_instance_weight("decode-1", 0.3, 600.0, "NIC flapping")
        assert weight.body["weight"] == pytest.approx(0.3) and weight.body["audit_id"]
        client.drain("prefill-1", "kernel upgrade", 900.0)
        client.undrain("prefill-1", "upgrade done")
        client.clear_instance_weight("decode-1", "NIC fixed")
        pool = client.set_pool_weight("decode", 2.0, 60.0, "shift load")
        assert pool.body["weight"] == pytest.approx(2.0)
        with pytest.raises(ControllerError) as err:
            ControllerClient("http://testserver", "wrong", transport=tc._transport).drain("prefill-0", "x")
        assert err.value.status == 401 and not err.value.retryable
        with pytest.raises(ControllerError) as err:
            client.set_instance_weight("no-such-instance", 1.0, 60.0, "typo")
        assert err.value.status == 404
    now = reconciler.clock() + 1.0
    audit = control.audit_trail(engine, Window(now - 60.0, now))
    assert list(audit["action"])[::-1] == [
        "weight.set",
        "drain",
        "undrain",
        "weight.clear",
        "pool_weight.set",
    ]
    assert set(audit["actor"]) == {"api:carol"}  # the token's identity, on behalf of carol
    active = fleet.active_overrides(engine, now)
    assert [(r.subject_kind, r.subject, r.weight) for r in active.itertuples() if r.actor == "api:carol"] == [
        ("pool", "decode", 2.0)
    ]
    engine.dispose()


def test_login_mode_whoami_and_the_users_own_token(tmp_path: Path) -> None:
    """Login mode against the real controller: whoami names the token's identity, and a change made
    with it is audited as that identity alone (no X-Actor is sent)."""
    seeded = make_seeded(tmp_path, duration_s=300.0)
    engine = make_engine(seeded.url)
    settings, factory = load_config(seeded.config), session_factory(engine)
    reconciler = Reconciler(settings, factory, effects=default_effects(settings, factory))
    with TestClient(create_app(reconciler, token=TOKEN, tokens={"carol": USER_TOKEN})) as tc:
        client = ControllerClient("http://testserver", USER_TOKEN, transport=tc._transport)
        assert client.whoami() == "carol"
        assert ControllerClient("http://testserver", TOKEN, transport=tc._transport).whoami() == "api"
        with pytest.raises(ControllerError) as err:
            ControllerClient("http://testserver", "wrong", transport=tc._transport).whoami()
        assert err.value.status == 401
        client.drain("prefill-1", "kernel upgrade")
    now = reconciler.clock() + 1.0
    audit = control.audit_trail(engine, Window(now - 60.0, now))
    assert list(audit["actor"]) == ["carol"]
    engine.dispose()
