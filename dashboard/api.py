"""The dashboard's only way to change anything: the controller's HTTP API.

``ControllerClient`` wraps the few calls the Controller page makes (routing table,
weight overrides, drain/undrain, pool weights, whoami) with a Bearer token and, on behalf of
a user identified by an auth proxy, an ``X-Actor`` header. httpx errors and
non-2xx answers are translated here into :class:`ControllerError`, whose ``retryable``
says whether trying again may help (controller down or busy) or not (bad token, bad
input). Calls block for at most ``timeout_s``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import httpx

log = logging.getLogger(__name__)


class ControllerError(Exception):
    """A controller call failed; ``status`` is the HTTP status when there was an answer."""

    def __init__(self, message: str, *, status: int | None = None, retryable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable


@dataclass(frozen=True)
class ApiResult:
    """A successful call: HTTP status and the decoded JSON body (or {})."""

    status: int
    body: dict[str, Any]


class ControllerClient:
    """A small blocking client for the controller API. Cheap to build; one per action."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        *,
        timeout_s: float = 5.0,
        transport: httpx.BaseTransport | None = None,
        actor: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._token = token
        self._timeout = timeout_s
        self._transport = transport
        self._actor = actor

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> ApiResult:
        # X-Actor only on behalf of someone (header mode); the controller prefixes it with the
        # token's identity. Header values go as UTF-8 bytes (a non-ASCII name stays intact).
        headers: dict[bytes, bytes] = {}
        if self._actor:
            headers[b"X-Actor"] = self._actor.encode("utf-8")
        if self._token:
            headers[b"Authorization"] = f"Bearer {self._token}".encode()
        try:
            with httpx.Client(
                base_url=self.base_url, timeout=self._timeout, transport=self._transport
            ) as client:
                resp = client.request(method, path, json=body, headers=headers)
        except httpx.TimeoutException as exc:
            raise ControllerError(
                f"controller at {self.base_url} did not answer in {self._timeout:g} s", retryable=True
            ) from exc
        except httpx.HTTPError as exc:
            raise ControllerError(
                f"cannot reach the controller at {self.base_url}: {exc}", retryable=True
            ) from exc
        try:
            payload = resp.json() if resp.content else {}
        except ValueError:
            payload = {"text": resp.text[:500]}
        if not isinstance(payload, dict):
            payload = {"value": payload}
        if resp.status_code >= 400:
            detail = (
                payload.get("detail") or payload.get("error") or payload.get("text") or resp.reason_phrase
            )
            log.warning("controller %s %s -> %s", method, path, resp.status_code)
            raise ControllerError(
                f"{method} {path}: HTTP {resp.status_code}: {detail}",
                status=resp.status_code,
                retryable=resp.status_code >= 500 or resp.status_code == 429,
            )
        log.info("controller %s %s -> %s", method, path, resp.status_code)
        return ApiResult(resp.status_code, payload)

    # -- reads -------------------------------------------------------------------------

    def routing(self) -> dict[str, Any]:
        """The current routing table (``GET /v1/routing``)."""
        return self._request("GET", "/v1/routing").body

    def replay(self, start: float, end: float, changes: Sequence[str] = ()) -> dict[str, Any]:
        """The policy re-run over ``start``..``end`` (``GET /v1/replay``), with each instance's served
        weights; ``changes`` (``name=value``) make it a candidate's replay."""
        query = urlencode(
            [("from", repr(start)), ("until", repr(end)), ("timeline", "true")]
            + [("set", c) for c in changes]
        )
        return self._request("GET", f"/v1/replay?{query}").body

    def whoami(self) -> str:
        """The identity the controller gives this client's token (``GET /v1/whoami``)."""
        identity = self._request("GET", "/v1/whoami").body.get("identity")
        if not isinstance(identity, str):
            raise ControllerError("GET /v1/whoami: the answer names no identity", status=200)
        return identity

    def pools(self) -> list[dict[str, Any]]:
        """Pools with their served instance weights and sources (``GET /v1/pools``)."""
        body = self._request("GET", "/v1/pools").body
        value = body.get("value", [])
        return value if isinstance(value, list) else []

    # -- actions -------------------------------------------------------------------------

    def set_instance_weight(self, instance: str, weight: float, ttl_s: float, reason: str) -> ApiResult:
        return self._request(
            "PUT", f"/v1/instances/{instance}/weight", {"weight": weight, "ttl_s": ttl_s, "reason": reason}
        )

    def clear_instance_weight(self, instance: str, reason: str) -> ApiResult:
        return self._request("DELETE", f"/v1/instances/{instance}/weight", {"reason": reason})

    def drain(self, instance: str, reason: str, ttl_s: float | None = None) -> ApiResult:
        body: dict[str, Any] = {"reason": reason}
        if ttl_s:
            body["ttl_s"] = ttl_s
        return self._request("POST", f"/v1/instances/{instance}/drain", body)

    def undrain(self, instance: str, reason: str) -> ApiResult:
        return self._request("POST", f"/v1/instances/{instance}/undrain", {"reason": reason})

    def set_pool_weight(self, pool: str, weight: float, ttl_s: float, reason: str) -> ApiResult:
        return self._request(
            "PUT", f"/v1/pools/{pool}/weight", {"weight": weight, "ttl_s": ttl_s, "reason": reason}
        )
