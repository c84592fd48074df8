from __future__ import annotations

import json

import httpx
import pytest

from dashboard.api import ControllerClient, ControllerError


def _client(handler, token: str | None = "tok") -> ControllerClient:  # type: ignore[no-untyped-def]
    return ControllerClient("http://ctl", token, transport=httpx.MockTransport(handler), actor="alice")


def test_weight_override_sends_body_token_and_actor() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"name": "decode-1", "weight": 0.3, "audit_id": 5})

    result = _client(handler).set_instance_weight("decode-1", 0.3, 600.0, "slow NIC")
    assert result.body["audit_id"] == 5
    req = seen[0]
    assert (req.method, req.url.path) == ("PUT", "/v1/instances/decode-1/weight")
    assert json.loads(req.content) == {"weight": 0.3, "ttl_s": 600.0, "reason": "slow NIC"}
    assert req.headers["authorization"] == "Bearer tok"
    assert req.headers["x-actor"] == "alice"


@pytest.mark.parametrize(
    ("call", "method", "path", "body"),
    [
        (lambda c: c.drain("p-0", "upgrade"), "POST", "/v1/instances/p-0/drain", {"reason": "upgrade"}),
        (
            lambda c: c.drain("p-0", "upgrade", 60.0),
            "POST",
            "/v1/instances/p-0/drain",
            {"reason": "upgrade", "ttl_s": 60.0},
        ),
        (lambda c: c.undrain("p-0", "done"), "POST", "/v1/instances/p-0/undrain", {"reason": "done"}),
        (
            lambda c: c.clear_instance_weight("d-0", "ok"),
            "DELETE",
            "/v1/instances/d-0/weight",
            {"reason": "ok"},
        ),
        (
            lambda c: c.set_pool_weight("decode", 2.0, 30.0, "shift"),
            "PUT",
            "/v1/pools/decode/weight",
            {"weight": 2.0, "ttl_s": 30.0, "reason": "shift"},
        ),
    ],
)
def test_each_action_uses_the_controller_route(call, method, path, body) -> None:  # type: ignore[no-untyped-def]
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={})

    call(_client(handler))
    assert (seen[0].method, seen[0].url.path, json.loads(seen[0].content)) == (method, path, body)


def test_errors_are_translated_with_retry_hint() -> None:
    def unauthorized(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"detail": "invalid token"})

    with pytest.raises(ControllerError) as err:
        _client(unauthorized).undrain("x", "r")
    assert err.value.status == 401 and not err.value.retryable and "invalid token" in str(err.value)

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with pytest.raises(ControllerError) as err:
        _client(down).routing()
    assert err.value.retryable and err.value.status is None

    def busy(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, text="store down")

    with pytest.raises(ControllerError) as err:
        _client(busy, token=None).routing()
    assert err.value.retryable and err.value.status == 503


def test_no_token_sends_no_authorization_header() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"version": 1})

    assert _client(handler, token=None).routing() == {"version": 1}
    assert "authorization" not in seen[0].headers


def test_no_actor_sends_no_x_actor_and_non_ascii_goes_as_utf8() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"identity": "carol"})

    assert ControllerClient("http://ctl", "tok", transport=httpx.MockTransport(handler)).whoami() == "carol"
    assert (seen[0].method, seen[0].url.path) == ("GET", "/v1/whoami")
    assert "x-actor" not in seen[0].headers
    ControllerClient("http://ctl", "tok", transport=httpx.MockTransport(handler), actor="José").routing()
    assert (b"X-Actor", "José".encode()) in seen[1].headers.raw


def test_whoami_without_an_identity_is_an_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"who": "?"})

    with pytest.raises(ControllerError, match="names no identity"):
        ControllerClient("http://ctl", "tok", transport=httpx.MockTransport(handler)).whoami()
