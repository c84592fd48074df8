"""The controller API's time query fields are bounded: NaN, infinities and values past the year 5138
are a 422 naming the field (they were taken, or a 400 without the field's location)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from controller.api import create_app
from tests.controller.conftest import World

API_CASES = [
    ("/v1/decisions?since=nan", "since"),
    ("/v1/decisions?since=-inf", "since"),
    ("/v1/decisions?since=1e300", "since"),
    ("/v1/slo/attribution?from=nan&until=10", "from"),
    ("/v1/slo/attribution?since=1h&until=inf", "until"),
    ("/v1/decisions/regret?from=nan", "from"),
    ("/v1/decisions/regret?until=inf", "until"),
]


@pytest.mark.parametrize(("path", "field"), API_CASES, ids=[p for p, _ in API_CASES])
def test_the_apis_time_fields_are_bounded(path: str, field: str, world: World) -> None:
    with TestClient(create_app(world.reconciler, token="t")) as c:
        r = c.get(path)
    assert r.status_code == 422, (path, r.text)
    assert any(d["loc"][-1] == field for d in r.json()["detail"]), r.text
