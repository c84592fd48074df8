"""What every router reads: the reconciler, the overrides service, the views; and the
dependencies of a mutation (its audit actor)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Query, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry

from controller.auth import Authenticator, audit_actor
from controller.endpoints.views import Views
from controller.loop import Reconciler
from controller.overrides import OverridesService
from controller.proxies import ProxyRegistry

XActor = Annotated[
    str | None,
    Header(
        description="on whose behalf (UTF-8, at most 64 characters); recorded "
        "as identity:X-Actor in the audit trail"
    ),
]


# The range parameters of the reads over a window of the store (attribution, replay)
Since = Annotated[str | None, Query(max_length=32, description="a duration back from now: 30m, 2h, 90s")]
# Unix seconds from 0 to 1e11 (the year 5138): NaN and infinities are a 422 naming the field
MAX_UNIX_S = 1e11
From = Annotated[
    float | None, Query(alias="from", ge=0, le=MAX_UNIX_S, description="Unix seconds (instead of since)")
]
Until = Annotated[float | None, Query(ge=0, le=MAX_UNIX_S, description="Unix seconds (default: now)")]


def bad_param(field: str, reason: str, status: int = 400) -> JSONResponse:
    """The error answer naming the parameter at fault: ``{"detail": [{"field", "reason"}]}``."""
    return JSONResponse(status_code=status, content={"detail": [{"field": field, "reason": reason}]})


@dataclass(frozen=True)
class ApiContext:
    reconciler: Reconciler
    authn: Authenticator
    registry: CollectorRegistry
    overrides: OverridesService
    views: Views
    proxies: ProxyRegistry


def caller(request: Request) -> str:
    """The audit actor of a mutation: the guard authenticated it before the body was read."""
    identity = request.scope.get("state", {}).get("identity")
    if not isinstance(identity, str):  # the guard runs first; this only guards against misuse
        raise HTTPException(401, detail="not authenticated", headers={"WWW-Authenticate": "Bearer"})
    return audit_actor(identity, request.scope["state"].get("x_actor"))


def _documents_x_actor(x_actor: XActor = None) -> None:
    """Lists X-Actor in the OpenAPI document; the guard reads and sanitises the raw header."""


MUTATION = [Depends(_documents_x_actor)]  # the dependencies of every mutation route
