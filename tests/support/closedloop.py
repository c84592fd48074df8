"""The whole loop, for end-to-end tests: fleet -> proxy -> collector -> store -> controller -> proxy, with
traffic flowing through the proxy. The fleet is a simulated one (``simulator.testing.running_fleet``) or
a real pair (``tests.real_vllm.pair.RealPair``): anything with ``config_yaml(**sections)``.

``async with closed_loop(fleet, tmp_path, "name", base) as loop:`` migrates a SQLite store under
``tmp_path``, starts the collector (its own thread), the controller's API with its reconcile loop and
pdscope's proxy following it (both on sockets bound here), then :func:`tests.support.traffic.traffic`
(``traffic_kw``: its keywords) through the proxy until the block ends. ``base`` is merged into the fleet's
config for every service
(``store`` and the controller's ``port`` are set here); ``proxy`` into the proxy's section (its
``controller_url`` and ``otlp_endpoint`` are set here). On leaving, the traffic stops (its outcomes are
logged) and every service is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy.orm import Session, sessionmaker

from pdscope.config import Settings, parse_config
from tests.support.collector import CollectorThread
from tests.support.serving import serve
from tests.support.sockets import bound_socket, url_of
from tests.support.traffic import traffic

log = logging.getLogger(__name__)


@dataclass
class ClosedLoop:
    settings: Settings  # every service's but the proxy's
    factory: sessionmaker[Session]
    ctl_url: str
    proxy_url: str
    http: httpx.AsyncClient

    async def routing(self) -> dict[str, Any]:
        """The controller's routing table now."""
        return (await self.http.get(f"{self.ctl_url}/v1/routing")).json()  # type: ignore[no-any-return]


@contextlib.asynccontextmanager
async def closed_loop(
    fleet: Any,
    tmp_path: Path,
    name: str,
    base: dict[str, Any],
    proxy: dict[str, Any] | None = None,
    alert_config: Any = None,
    traffic_kw: dict[str, Any] | None = None,
) -> AsyncIterator[ClosedLoop]:
    from controller.api import create_app
    from controller.loop import Reconciler
    from controller.wiring import default_effects
    from proxy.app import build as build_proxy
    from store.db import make_engine, session_factory
    from store.migrate import upgrade

    url = f"sqlite:///{tmp_path / f'{name}.db'}"
    upgrade(url)
    ctl_sock, proxy_sock = bound_socket(), bound_socket()
    ctl_url, proxy_url = url_of(ctl_sock), url_of(proxy_sock)
    controller = {**base.get("controller", {}), "port": ctl_sock.getsockname()[1]}
    sections = {**base, "store": {"url": url}, "controller": controller}
    settings = parse_config(fleet.config_yaml(**sections), f"{name}.yaml")
    collector = CollectorThread(settings)
    own = {"controller_url": ctl_url, "otlp_endpoint": f"http://127.0.0.1:{collector.port}"}
    proxy_settings = parse_config(
        fleet.config_yaml(**sections, proxy={**(proxy or {}), **own}), f"{name}-proxy.yaml"
    )
    engine = make_engine(url)
    factory = session_factory(engine)
    extra = {} if alert_config is None else {"alert_config": alert_config}
    reconciler = Reconciler(settings, factory, effects=default_effects(settings, factory), **extra)
    stop_traffic = asyncio.Event()
    collector.__enter__()
    load: asyncio.Task[dict[str, int]] | None = None
    try:
        async with (
            serve(create_app(reconciler, token="t", run_loop=True), sock=ctl_sock, stop_timeout_s=15),
            serve(build_proxy(proxy_settings), sock=proxy_sock, stop_timeout_s=15),
            httpx.AsyncClient(timeout=15.0) as http,
        ):
            load = asyncio.create_task(traffic(proxy_url, stop_traffic, **(traffic_kw or {})))
            yield ClosedLoop(settings, factory, ctl_url, proxy_url, http)
    finally:
        stop_traffic.set()
        if load is not None:
            counts = await asyncio.wait_for(load, timeout=20)
            log.info("traffic outcomes: %s", counts)
        await asyncio.to_thread(collector.__exit__)
        engine.dispose()
