"""The control API (FastAPI; OpenAPI at ``/openapi.json``, docs at ``/docs``).

Reads are open (the proxy polls ``GET /v1/routing``); every mutation needs
``Authorization: Bearer <token>``, checked by :class:`controller.guard.RequestGuard` before
any of the body is read (which also bounds the body's size and nesting). The audit actor is
the token's identity (``identity:X-Actor`` when that header is sent; see
``controller.auth``). Mutations go through :class:`controller.overrides.OverridesService`
(serialised per subject, written and audited in one transaction). Bad input is a 4xx naming
the field and the reason, and nothing is written.

This module only assembles: the routers (one per concern, :mod:`controller.endpoints`) and
the translation of errors at the boundary: ``store.StoreError`` becomes 503 (a retry may
help), an unknown instance or pool 404, clearing what is not there 409, a mutation sent to a
standby 409 naming the leader (``controller.leader.NotLeader``). It does no policy.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry

from controller.auth import API_IDENTITY, Authenticator
from controller.endpoints import (
    alerts,
    attribution,
    bundles,
    history,
    ops,
    overrides,
    proxies,
    regret,
    replay,
    routing,
    tenants,
)
from controller.endpoints.context import ApiContext
from controller.endpoints.views import Views
from controller.forward import Forwarder
from controller.guard import RequestGuard
from controller.leader import NotLeader, leader_url
from controller.loop import Reconciler
from controller.notify import Notifier, NullNotifier
from controller.overrides import NothingToClear, OverridesService, UnknownSubject
from controller.proxies import ProxyRegistry
from pdscope.auththrottle import AuthFailureCollector, AuthThrottle
from store.db import StoreError

log = logging.getLogger(__name__)

ROUTERS = (
    routing,
    proxies,
    history,
    regret,
    alerts,
    attribution,
    tenants,
    replay,
    bundles,
    ops,
    overrides,
)  # reads first, as the OpenAPI document lists them


def create_app(
    reconciler: Reconciler,
    *,
    token: str | None,
    tokens: Mapping[str, str] | None = None,
    registry: CollectorRegistry | None = None,
    notifier: Notifier | None = None,
    run_loop: bool = False,
    proxy_tokens: Mapping[str, str] | None = None,
) -> FastAPI:
    """The app. ``token`` is identity ``"api"``'s; ``tokens`` maps more identities to theirs.
    ``proxy_tokens`` (token -> proxy identity) authenticate proxy reports; None: read from the
    environment (``controller.proxy_tokens_env``). With ``run_loop`` the reconcile loop runs for
    the app's lifetime."""
    settings = reconciler.settings
    ids = dict(tokens or {})
    if token:
        ids[API_IDENTITY] = token
    throttle = AuthThrottle.from_settings("controller API", settings.controller.auth_throttle)
    authn = Authenticator(
        ids,
        disabled_detail=f"mutations are disabled: no API token is configured "
        f"(set ${settings.controller.api_token_env} or ${settings.controller.api_tokens_env})",
        throttle=throttle,
    )
    notif = notifier or NullNotifier()
    registry_of_proxies = ProxyRegistry(
        reconciler.factory,
        settings,
        me=reconciler.leadership.holder,
        tokens=settings.proxy_tokens() if proxy_tokens is None else proxy_tokens,
        secret=settings.proxy_secret(),
        clock=reconciler.clock,
    )
    if registry is None:
        from controller.metrics import make_registry

        registry = make_registry(reconciler, notif, registry_of_proxies)
    registry.register(AuthFailureCollector(throttle, "pdscope_controller_auth_failures"))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stop = asyncio.Event()
        task = asyncio.create_task(reconciler.run_forever(stop)) if run_loop else None
        try:
            yield
        finally:
            stop.set()
            if task is not None:
                await task
            await asyncio.to_thread(notif.close)

    app = FastAPI(
        title="pdscope controller",
        version="1",
        description="Routing table for proxies, manual overrides with TTL and reason, drain, decisions, "
        "alerts, SLO status. Mutations need `Authorization: Bearer <token>`.",
        lifespan=lifespan,
    )
    app.add_middleware(RequestGuard, auth=authn, max_body_bytes=settings.controller.max_body_bytes)
    forwarder = None
    if settings.controller.forward_changes:
        forwarder = Forwarder(leader_url(reconciler.leadership.holder))
        registry.register(forwarder)
    _translate_errors(app, forwarder)
    service = OverridesService(reconciler)
    ctx = ApiContext(reconciler, authn, registry, service, Views(reconciler, service), registry_of_proxies)
    for module in ROUTERS:
        app.include_router(module.router(ctx))
    app.state.proxies = registry_of_proxies  # for tests and embedding
    return app


def _translate_errors(app: FastAPI, forwarder: Forwarder | None = None) -> None:
    """Errors become answers here, at the boundary: 422 naming the field, 404, 409 (nothing to clear;
    a standby, naming the leader), 503."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for e in exc.errors():
            loc = [str(p) for p in e.get("loc", ()) if p not in ("body", "query", "path", "header")]
            if e.get("type") == "json_invalid":  # loc is a character position, not a field
                loc = []
            problems.append(
                {
                    "field": ".".join(loc) or "body",
                    "reason": e.get("msg", "invalid"),
                    "loc": list(e.get("loc", ())),
                    "msg": e.get("msg"),
                    "type": e.get("type"),
                }
            )
        return JSONResponse(status_code=422, content=jsonable_encoder({"detail": problems}))

    @app.exception_handler(UnknownSubject)
    async def _unknown(request: Request, exc: UnknownSubject) -> JSONResponse:
        return JSONResponse(status_code=404, content={"detail": exc.detail})

    @app.exception_handler(NothingToClear)
    async def _nothing(request: Request, exc: NothingToClear) -> JSONResponse:
        return JSONResponse(status_code=409, content={"detail": exc.detail})

    @app.exception_handler(NotLeader)
    async def _standby(request: Request, exc: NotLeader) -> Response:
        known = None if exc.leader is None or not exc.leader.holder else exc.leader
        detail = exc.detail
        target = None if known is None else leader_url(known.holder)
        if forwarder is not None and forwarder.wanted(request, target):
            assert target is not None
            answer = await forwarder.forward(request, target)
            if isinstance(answer, Response):
                return answer
            detail = f"{detail} ({answer})"
        leader = None if known is None else {**known.as_dict(), "url": target}
        return JSONResponse(status_code=409, content={"detail": detail, "leader": leader})

    @app.exception_handler(StoreError)
    async def _store_down(request: Request, exc: StoreError) -> JSONResponse:
        log.warning("store error on %s %s: %s", request.method, request.url.path, exc)
        return JSONResponse(
            status_code=503, content={"detail": f"store unavailable: {exc}"}, headers={"Retry-After": "2"}
        )
