"""``pdscope control``: the controller's command line (argparse and config only here).

Serves the control API on ``controller.host:port`` and runs the reconcile loop inside
the same process. Refuses to listen on a non-loopback address without an API token
(``$PDSCOPE_API_TOKEN`` or a named one in ``$PDSCOPE_API_TOKENS``), to start when a
token variable is malformed, and to start a second controller on one SQLite file (its lock,
``controller.leader.FileLock``, names the pid running). On PostgreSQL any number start: one
leads, the others stand by (``controller.leader.PgAdvisoryLock``).
Heavy imports (FastAPI, SQLAlchemy, uvicorn) happen inside :func:`run`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Any

from pdscope.config import Settings, is_loopback

if TYPE_CHECKING:
    from controller.leader import Leadership

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="API address (default: controller.host)")
    parser.add_argument("--port", type=int, help="API port (default: controller.port)")
    parser.add_argument("--mode", choices=("advisory", "enforce"), help="override controller.mode")
    parser.add_argument("--store", help="store URL (default: store.url)")
    parser.add_argument(
        "--no-migrate",
        action="store_true",
        help="do not apply the store's migrations at start (default: apply them)",
    )


def check_listen(host: str, token: str | None, env_name: str) -> str | None:
    """A reason to refuse to start, or None."""
    if not is_loopback(host) and not token:
        return (
            f"refusing to listen on {host} (not loopback) without an API token: set ${env_name} "
            f"or bind 127.0.0.1"
        )
    return None


def run(args: argparse.Namespace) -> int:
    from pdscope.config import load_settings

    settings: Settings = load_settings(args)
    c = settings.controller
    host = args.host or c.host
    port = args.port or c.port
    updates: dict[str, object] = {"host": host, "port": port}
    if args.mode:
        updates["mode"] = args.mode
    store_update = {"url": args.store} if args.store else {}
    settings = settings.model_copy(
        update={
            "controller": c.model_copy(update=updates),
            "store": settings.store.model_copy(update=store_update),
        }
    )
    from controller.auth import API_IDENTITY, IdentityConfigError, load_tokens
    from pdscope.config import ConfigError

    try:
        tokens = load_tokens(settings)
    except IdentityConfigError as exc:
        print(f"pdscope control: {exc}", file=sys.stderr)
        return 1
    try:
        settings.proxy_tokens()  # read again by the app; a bad entry stops the start here
    except ConfigError as exc:
        print(f"pdscope control: {exc}", file=sys.stderr)
        return 1
    token = tokens.pop(API_IDENTITY, None)
    refusal = check_listen(
        host, token or ("named" if tokens else None), f"{c.api_token_env} or ${c.api_tokens_env}"
    )
    if refusal:
        print(f"pdscope control: {refusal}", file=sys.stderr)
        return 1
    return serve(settings, token, migrate=not args.no_migrate, tokens=tokens)


def serve(
    settings: Settings, token: str | None, *, migrate: bool = True, tokens: dict[str, str] | None = None
) -> int:
    from controller.leader import LeadershipError, advertise_url, default_holder, lease_for, open_leadership

    c = settings.controller
    holder = default_holder(c.port, advertise_url(c.host, c.port, c.advertise_url))
    try:  # before migrating: a second controller on a SQLite store changes nothing
        leadership = open_leadership(settings.store.url, holder, lease_for(c.interval_s))
    except LeadershipError as exc:
        print(f"pdscope control: {exc.detail}", file=sys.stderr)
        return 1
    try:
        return _serve(settings, token, leadership, migrate=migrate, tokens=tokens)
    finally:
        leadership.release()


def _notifier(settings: Settings, external: str, bundler: Any) -> Any:
    """The alert webhook (each alert annotated with its attribution link and bundle), or none."""
    from controller.attribution import attribution_link
    from controller.notify import NullNotifier, WebhookNotifier

    url = settings.controller.alert_webhook_url
    if not url:
        return NullNotifier()
    return WebhookNotifier(
        url,
        external,
        annotate=lambda st: {
            **attribution_link(external, st, settings.slo.window_s),
            **bundler.annotations(st),
        },
    )


def _serve(
    settings: Settings,
    token: str | None,
    leadership: Leadership,
    *,
    migrate: bool,
    tokens: dict[str, str] | None,
) -> int:
    import time

    import uvicorn
    from sqlalchemy.exc import SQLAlchemyError

    from controller.api import create_app
    from controller.bundle import make_bundler
    from controller.loop import Reconciler
    from controller.policy import AlertConfig
    from controller.wiring import default_effects
    from pdscope.httpserve import server_options
    from store.db import StoreError, make_engine, session_factory
    from store.migrate import upgrade

    c = settings.controller
    if migrate:
        for attempt in range(3):  # another service may be migrating the same store right now
            try:
                upgrade(settings.store.url)
                break
            except (StoreError, SQLAlchemyError) as exc:  # e.g. "table already exists" mid-race
                if attempt == 2:
                    print(f"pdscope control: cannot migrate the store: {exc}", file=sys.stderr)
                    return 1
                time.sleep(1.0)
    engine = make_engine(settings.store.url)
    external = f"http://{c.host}:{c.port}"
    factory = session_factory(engine)
    bundler = make_bundler(settings, factory, url_base=f"{external}/v1/bundles")
    notifier = _notifier(settings, external, bundler)
    effects = default_effects(settings, factory, notifier=notifier, bundler=bundler)
    reconciler = Reconciler(
        settings,
        factory,
        effects=effects,
        alert_config=AlertConfig.from_settings(settings),
        leadership=leadership,
    )
    app = create_app(reconciler, token=token, tokens=tokens, notifier=notifier, run_loop=True)
    names = sorted({*(tokens or {}), *(["api"] if token else [])})
    log.info(
        "controller %s on %s (mode %s, every %ss, window %ss, identities %s, %s)",
        leadership.holder,
        external,
        reconciler.mode,
        c.interval_s,
        c.window_s,
        ", ".join(names) or "none: mutations disabled",
        "leads" if reconciler.role == "leader" else "standby until it takes the lock",
    )
    try:
        with reconciler.collections:  # the loop paces CPython's full collections (controller.gcpace)
            uvicorn.run(
                app,
                host=c.host,
                port=c.port,
                log_level="warning",
                access_log=False,
                **server_options(c.header_timeout_s, c.max_connections),
            )
    finally:
        bundler.close()  # the bundles queued are written first (a few seconds at most)
        engine.dispose()
    return 0
