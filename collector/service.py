"""The collector process: scraper, OTLP receiver, forensics and retention in one event loop.

``CollectorService.run(stop)`` serves the receiver app with uvicorn on a socket it binds
itself (so ``port: 0`` works and ``.port`` tells which), scrapes on the configured
interval (or, with ``collector.prometheus_url``, reads the same signals from Prometheus:
``collector.promsource``), drains the span queue into the store, and every scrape interval runs the
lease-expiry forensics over recent records and the retention pass. Store work runs in
worker threads; a store error is logged and counted, and the loops go on. It stops when
``stop`` is set, flushing the queued spans first.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Sequence

import httpx
import uvicorn
from sqlalchemy.orm import Session, sessionmaker

from collector import forensics
from collector.promsource import PromSource
from collector.receiver import SpanBatcher, SpanQueue, build_app
from collector.retention import Retention
from collector.scraper import PerOriginTransport, Scraper, ScrapeResult
from collector.selfmetrics import CollectorMetrics
from collector.sink import Sink, StoreSink
from collector.snapshot_store import SnapshotStore
from collector.targets import Target, targets_from_settings
from pdscope.config import Settings
from store.db import StoreError, make_engine, session_factory, transaction

log = logging.getLogger(__name__)

FORENSICS_WINDOW_S = 300.0


class CollectorService:
    def __init__(
        self,
        settings: Settings,
        *,
        factory: sessionmaker[Session] | None = None,
        targets: Sequence[Target] | None = None,
        sink: Sink | None = None,
        queue_spans: int = 200_000,
        port: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        cs = settings.collector
        self.factory = factory or session_factory(make_engine(settings.store.url))
        self.targets = list(targets if targets is not None else targets_from_settings(settings))
        self.metrics = CollectorMetrics()
        self.snapshots = SnapshotStore(self.factory)
        self.queue = SpanQueue(queue_spans)
        self.sink = sink or StoreSink(self.factory, settings.slo, clock)
        self.batcher = SpanBatcher(self.queue, self.sink, self.metrics)
        self.retention = Retention(self.factory, settings.store.retention_raw_s, settings.store.retention_rollup_s)
        self.clock = clock
        self.app = build_app(self.queue, self.metrics)
        self.client = httpx.AsyncClient(
            transport=PerOriginTransport(), timeout=httpx.Timeout(cs.scrape_timeout_s), follow_redirects=False
        )
        self.scraper = Scraper(
            self.targets,
            self.client,
            interval_s=cs.scrape_interval_s,
            timeout_s=cs.scrape_timeout_s,
            max_body_bytes=cs.max_body_bytes,
            on_round=self.store_round,
        )
        # collector.prometheus_url: rounds come from Prometheus instead (collector.promsource)
        self.promsource: PromSource | None = None
        if cs.prometheus_url:
            self.promsource = PromSource(
                self.targets,
                cs.prometheus_url,
                interval_s=cs.scrape_interval_s,
                timeout_s=cs.scrape_timeout_s,
                max_body_bytes=8 * cs.max_body_bytes,  # one answer covers the whole fleet
                on_round=self.store_round,
                instance_label=cs.prometheus_instance_label,
                selector=cs.prometheus_selector,
                registry=self.metrics.registry,
                clock=clock,
            )
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((cs.host, cs.port if port is None else port))  # port 0: any free one
        self.port: int = self.sock.getsockname()[1]
        self.started = asyncio.Event()

    async def store_round(self, results: list[ScrapeResult]) -> None:
        self.metrics.observe_round(results)
        before = dict(self.snapshots.resets)
        try:
            n = await asyncio.to_thread(self.snapshots.write_round, results)
            self.metrics.snapshots.inc(n)
        except StoreError as exc:
            self.metrics.store_errors.labels("snapshots").inc()
            log.warning("snapshot round not stored: %s", exc)
        for inst, count in self.snapshots.resets.items():
            if count > before.get(inst, 0):
                self.metrics.resets.labels(inst).inc(count - before.get(inst, 0))

    def maintenance(self) -> None:
        """Forensics over recent records, then retention. Blocking; raises StoreError."""
        now = self.clock()
        with transaction(self.factory) as session:
            forensics.run_pass(session, now - FORENSICS_WINDOW_S, now)
        self.retention.run(now)

    async def _maintenance_loop(self, stop: asyncio.Event) -> None:
        interval = self.settings.collector.scrape_interval_s
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval)
            except TimeoutError:
                pass
            try:
                await asyncio.to_thread(self.maintenance)
            except StoreError as exc:
                self.metrics.store_errors.labels("maintenance").inc()
                log.warning("forensics/retention pass failed: %s", exc)

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await asyncio.to_thread(self.snapshots.ensure_instances, self.targets, self.clock())
        except StoreError as exc:
            log.warning("instances not recorded: %s", exc)
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False)
        server = uvicorn.Server(config)
        server_task = asyncio.create_task(server.serve(sockets=[self.sock]))
        tasks = [
            asyncio.create_task((self.promsource or self.scraper).run(stop)),
            asyncio.create_task(self.batcher.run(stop)),
            asyncio.create_task(self._maintenance_loop(stop)),
        ]
        while not server.started and not server_task.done():  # noqa: ASYNC110 (uvicorn offers no event)
            await asyncio.sleep(0.01)
        self.started.set()
        log.info(
            "collector up on %s:%d: %d targets every %gs from %s",
            self.settings.collector.host,
            self.port,
            len(self.targets),
            self.settings.collector.scrape_interval_s,
            self.promsource.url if self.promsource else "their /metrics",
        )
        try:
            await stop.wait()
        finally:
            await asyncio.gather(*tasks, return_exceptions=True)
            server.should_exit = True
            await asyncio.gather(server_task, return_exceptions=True)
            await self.client.aclose()
            self.sock.close()
