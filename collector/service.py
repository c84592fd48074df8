"""The collector process: scraper, OTLP receiver, forensics and retention in one event loop.

``CollectorService.run(stop)`` serves the receiver app with uvicorn on a socket it binds
itself (so ``port: 0`` works and ``.port`` tells which), scrapes on the configured
interval (or, with ``collector.prometheus_url``, reads the same signals from Prometheus:
``collector.promsource``), drains the span queue into the store, and every scrape interval runs the
lease-expiry forensics over recent records and the retention pass. Store work runs in
worker threads. Every background task catches what a turn raises, counts it
(``pdscope_collector_task_errors_total{task,reason}``), logs it (rate-limited) and goes
on; each beats ``TaskHealth``, and ``/healthz`` answers 503 for a task that is dead or
has not beaten within its bound. At most ``MAX_PENDING_ROUNDS`` scrape rounds wait for
the store at once; a round past that is not stored (counted). It stops when ``stop`` is
set, flushing the queued spans first and leaving the collectors' membership.

Each scrape round covers this collector's share of the instances (``collector.membership``:
on PostgreSQL the live collectors split them; on SQLite it is alone and scrapes all), and
forensics and retention run on one collector only (the live one with the smallest id).

With ``collector.otlp_tokens_env`` unset or empty, OTLP is unauthenticated and the
service refuses to bind a non-loopback ``collector.host`` (``InsecureBind``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import socket
import tempfile
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette

from collector import forensics
from collector.health import RateLimitedLog, TaskHealth
from collector.ingest import SpanLimits
from collector.membership import LIVE_INTERVALS, Membership, Shard, shared_store
from collector.promsource import PromSource
from collector.receiver import ReceiverConfig, SpanBatcher, build_app
from collector.retention import Retention
from collector.scraper import PerOriginTransport, Scraper, ScrapeResult
from collector.selfmetrics import CollectorMetrics
from collector.sink import Sink, StoreSink
from collector.snapshot_store import SnapshotStore
from collector.spool import Spool, SpoolConfig, SpoolLocked
from collector.targets import ScrapeTarget, targets_from_settings
from pdscope.auththrottle import AuthFailureCollector, AuthThrottle
from pdscope.config import Settings, is_loopback
from pdscope.httpserve import server_options
from store.db import StoreError, make_engine, session_factory, transaction

log = logging.getLogger(__name__)

FORENSICS_WINDOW_S = 300.0
MAX_PENDING_ROUNDS = 2
SCRAPER, SNAPSHOTS, MAINTENANCE = "scraper", "snapshot_writer", "maintenance"


class InsecureBind(ValueError):
    """Refusing to serve unauthenticated OTLP on a non-loopback address."""


def check_bind(host: str, tokens: Mapping[str, str], env_name: str) -> None:
    """Raise InsecureBind for a non-loopback host without OTLP tokens."""
    if not tokens and not is_loopback(host):
        raise InsecureBind(
            f"refusing to receive OTLP on {host} (not loopback) without authentication: set ${env_name} "
            "to sender:token[,sender:token...] or bind 127.0.0.1"
        )


def receiver_config(settings: Settings, tokens: Mapping[str, str]) -> ReceiverConfig:
    cs = settings.collector
    return ReceiverConfig(
        max_body_bytes=cs.otlp_max_body_bytes,
        max_inflated_bytes=cs.otlp_max_inflated_bytes,
        inflight_bytes=cs.otlp_inflight_bytes,
        retry_after_s=cs.otlp_retry_after_s,
        limits=SpanLimits(
            max_attributes=cs.span_max_attributes,
            max_value_chars=cs.span_max_value_chars,
            max_attribute_chars=cs.span_max_attribute_chars,
            max_future_s=cs.span_max_future_s,
            max_age_s=settings.store.retention_raw_s,
        ),
        tokens=dict(tokens),
        auth_throttle=AuthThrottle.from_settings("OTLP receiver", cs.auth_throttle),
    )


class SpoolUnusable(RuntimeError):
    """The spool folder cannot be used (in use by another process, or the disk refuses)."""


def default_spool_dir(store_url: str, collector_id: str) -> Path:
    """<temp dir>/pdscope-spool/<hash>: one folder per store and collector id, found again after a
    restart of the process on the same host."""
    key = hashlib.sha256(f"{store_url}\0{collector_id}".encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "pdscope-spool" / key


def spool_config(settings: Settings, collector_id: str, memory_spans: int | None = None) -> SpoolConfig:
    cs = settings.collector
    if cs.spool_dir == ":memory:":
        directory = None
    elif cs.spool_dir:
        directory = Path(cs.spool_dir).expanduser()
    else:
        directory = default_spool_dir(settings.store.url, collector_id)
    return SpoolConfig(
        directory=directory,
        max_bytes=cs.spool_max_bytes,
        max_age_s=cs.spool_max_age_s,
        max_memory_spans=cs.span_queue_spans if memory_spans is None else memory_spans,
        segment_bytes=cs.spool_segment_bytes,
        fsync=cs.spool_fsync,
    )


def store_sink(settings: Settings, factory: sessionmaker[Session], clock: Callable[[], float]) -> StoreSink:
    """The sink of the configured SLO and tenants. On a shared store (PostgreSQL) a trace's spans may
    reach any collector, so every batch reads the stored spans of all its traces (collector.sink)."""
    return StoreSink(factory, settings.slo, clock, shared=shared_store(factory), tenants=settings.tenants)


class CollectorService:
    def __init__(
        self,
        settings: Settings,
        *,
        factory: sessionmaker[Session] | None = None,
        targets: Sequence[ScrapeTarget] | None = None,
        sink: Sink | None = None,
        queue_spans: int | None = None,
        port: int | None = None,
        clock: Callable[[], float] = time.time,
        otlp_tokens: Mapping[str, str] | None = None,
    ) -> None:
        self.settings = settings
        cs = settings.collector
        tokens = cs.otlp_tokens() if otlp_tokens is None else otlp_tokens  # raises ConfigError
        check_bind(cs.host, tokens, cs.otlp_tokens_env)
        self.health = TaskHealth()
        httpx_log = logging.getLogger("httpx")
        if (
            httpx_log.level == logging.NOTSET
        ):  # httpx logs every request at INFO: one line per target per scrape
            httpx_log.setLevel(logging.WARNING)
        self._warn = RateLimitedLog(log)
        self._storing = 0
        self.factory = factory or session_factory(make_engine(settings.store.url))
        self.targets = list(targets if targets is not None else targets_from_settings(settings))
        self.metrics = CollectorMetrics()
        self.snapshots = SnapshotStore(self.factory)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((cs.host, cs.port if port is None else port))  # port 0: any free one
        self.port = self.sock.getsockname()[1]
        self.id = cs.id or f"{socket.gethostname()}:{self.port}"
        self.spool = Spool(spool_config(settings, self.id, queue_spans), clock)
        self.sink = sink or store_sink(settings, self.factory, clock)
        self.batcher = SpanBatcher(self.spool, self.sink, self.metrics, health=self.health)
        self.retention = Retention(
            self.factory, settings.store.retention_raw_s, settings.store.retention_rollup_s
        )
        self.clock = clock
        self.shard = self._shard()
        self.app = self._app(receiver_config(settings, tokens))
        self._register_tasks()
        self.client = httpx.AsyncClient(
            transport=PerOriginTransport(), timeout=httpx.Timeout(cs.scrape_timeout_s), follow_redirects=False
        )
        self.scraper, self.promsource = self._sources()
        self.started = asyncio.Event()

    def _shard(self) -> Shard:
        """This collector's share of the targets: all of them unless the store is shared."""
        cs = self.settings.collector
        return Shard(
            self.targets,
            self.id,
            membership=(
                Membership(self.factory, self.id, window_s=LIVE_INTERVALS * cs.scrape_interval_s)
                if shared_store(self.factory)
                else None
            ),
            interval_s=cs.scrape_interval_s,
            timeout_s=cs.scrape_timeout_s,
            metrics=self.metrics,
            clock=self.clock,
        )

    def _app(self, receiver: ReceiverConfig) -> Starlette:
        """The receiver app (OTLP, /metrics with the auth failures, /healthz)."""
        self.metrics.registry.register(
            AuthFailureCollector(receiver.auth_throttle, "pdscope_collector_auth_failures")
        )
        return build_app(
            self.spool,
            self.metrics,
            receiver,
            health=self.health,
            clock=self.clock,
            collectors=self.shard.report,
        )

    def _register_tasks(self) -> None:
        """The background tasks' bounds on the time between beats."""
        cs = self.settings.collector
        interval = cs.scrape_interval_s
        self.health.register(SCRAPER, 3 * interval + cs.scrape_timeout_s + 30.0)
        self.health.register(SNAPSHOTS, max(120.0, 6 * interval))
        self.health.register(MAINTENANCE, max(600.0, 5 * interval))

    def _sources(self) -> tuple[Scraper, PromSource | None]:
        """The scraper and, with ``collector.prometheus_url``, the source the rounds come from instead
        (``collector.promsource``)."""
        cs = self.settings.collector
        scraper = Scraper(
            self.targets,
            self.client,
            interval_s=cs.scrape_interval_s,
            timeout_s=cs.scrape_timeout_s,
            max_body_bytes=cs.max_body_bytes,
            on_round=self.store_round,
            on_tick=lambda: self.health.beat(SCRAPER),
            assign=self.shard.refresh,
        )
        if not cs.prometheus_url:
            return scraper, None
        promsource = PromSource(
            self.targets,
            cs.prometheus_url,
            interval_s=cs.scrape_interval_s,
            timeout_s=cs.scrape_timeout_s,
            max_body_bytes=8 * cs.max_body_bytes,  # one answer covers the whole fleet
            on_round=self.store_round,
            instance_label=cs.prometheus_instance_label,
            selector=cs.prometheus_selector,
            registry=self.metrics.registry,
            clock=self.clock,
            on_tick=lambda: self.health.beat(SCRAPER),
            assign=self.shard.refresh,
        )
        return scraper, promsource

    def _task_error(self, task: str, exc: BaseException) -> None:
        self.metrics.task_errors.labels(task, type(exc).__name__).inc()
        self.health.error(task, exc)
        self._warn.warning(task, "%s: turn failed: %r", task, exc, exc_info=exc)

    async def store_round(self, results: list[ScrapeResult]) -> None:
        """Self-metrics and snapshots of one round; never raises."""
        try:
            self.metrics.observe_round(results)
        except Exception as exc:
            self._task_error(SNAPSHOTS, exc)
        if self._storing >= MAX_PENDING_ROUNDS:  # the store is slower than the scrapes: skip, do not pile up
            self.metrics.store_errors.labels("snapshots_skipped").inc()
            self._warn.warning(
                "snapshots_skipped",
                "snapshot round not stored: %d rounds still waiting for the store",
                self._storing,
            )
            return
        self._storing += 1
        try:
            before = dict(self.snapshots.resets)
            n = await asyncio.to_thread(self.snapshots.write_round, results)
            self.health.store(True)
            self.metrics.snapshots.inc(n)
            for inst, count in self.snapshots.resets.items():
                if count > before.get(inst, 0):
                    self.metrics.resets.labels(inst).inc(count - before.get(inst, 0))
        except StoreError as exc:
            self.metrics.store_errors.labels("snapshots").inc()
            self.health.store(False, str(exc))
            self._warn.warning("snapshots_store", "snapshot round not stored: %s", exc)
        except Exception as exc:
            self._task_error(SNAPSHOTS, exc)
        finally:
            self._storing -= 1
            self.health.beat(SNAPSHOTS)

    def maintenance(self) -> None:
        """Forensics over recent records, then retention. Blocking; raises StoreError."""
        now = self.clock()
        with transaction(self.factory) as session:
            forensics.run_pass(
                session, now - FORENSICS_WINDOW_S, now, lease_s=self.settings.controller.kv_lease_s
            )
        self.retention.run(now)

    async def _maintenance_loop(self, stop: asyncio.Event) -> None:
        interval = self.settings.collector.scrape_interval_s
        while not stop.is_set():
            self.health.beat(MAINTENANCE)
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval)
            except TimeoutError:
                pass
            if not self.shard.runs_maintenance():  # another live collector runs it
                self.health.beat(MAINTENANCE)
                continue
            try:
                await asyncio.to_thread(self.maintenance)
            except StoreError as exc:
                self.metrics.store_errors.labels("maintenance").inc()
                self._warn.warning("maintenance_store", "forensics/retention pass failed: %s", exc)
            except Exception as exc:
                self._task_error(MAINTENANCE, exc)
            self.health.beat(MAINTENANCE)

    async def _leave(self) -> None:
        """A clean stop deletes this collector's membership row: its peers take its share at once."""
        try:
            await asyncio.wait_for(
                asyncio.to_thread(self.shard.leave), self.settings.collector.scrape_timeout_s
            )
        except (StoreError, TimeoutError) as exc:
            log.warning(
                "collector %s: membership not cleared at stop (%s); peers wait out its heartbeat",
                self.id,
                exc,
            )

    def _supervise(
        self, name: str, coro: Coroutine[Any, Any, None], stop: asyncio.Event
    ) -> asyncio.Task[None]:
        """Run a background task; one that ends while the collector runs is marked dead."""
        task = asyncio.create_task(coro, name=f"collector-{name}")

        def done(t: asyncio.Task[None]) -> None:
            if stop.is_set():
                return
            exc = None if t.cancelled() else t.exception()
            why = "cancelled" if t.cancelled() else (f"{type(exc).__name__}: {exc}" if exc else "returned")
            self.health.died(name, why)
            self.metrics.task_errors.labels(name, "died").inc()
            log.error("collector task %s ended while running: %s", name, why, exc_info=exc)

        task.add_done_callback(done)
        return task

    def open_spool(self) -> None:
        """Take the spool folder and read back what a previous process left (written to the store
        first, in order). Raises SpoolUnusable naming ``collector.spool_dir``."""
        d = self.spool.cfg.directory
        try:
            rec = self.spool.open()
        except (SpoolLocked, OSError) as exc:
            raise SpoolUnusable(f"collector.spool_dir: cannot use {d}: {exc}") from exc
        for note in rec.notes:
            log.warning("spool %s: %s", d, note)
        if rec.batches or rec.corrupt:
            log.warning(
                "spool %s: %d span batches (%d spans) from before the restart go to the store first; "
                "%d unreadable records skipped",
                d,
                rec.batches,
                rec.spans,
                rec.corrupt,
            )
        self.metrics.queue.set(len(self.spool))

    def close_spool(self) -> None:
        d = self.spool.cfg.directory
        left = self.spool.pending_spans
        self.spool.close()
        if left and d is None:
            log.error("collector stopped with %d spans not in the store (in-memory spool: lost)", left)
        elif left:
            log.warning(
                "collector stopped with %d spans in the spool %s: the next start writes them", left, d
            )
        elif d is not None and d == default_spool_dir(self.settings.store.url, self.id):
            with contextlib.suppress(OSError):
                d.rmdir()

    async def run(self, stop: asyncio.Event) -> None:
        self.open_spool()
        try:
            await self._run(stop)
        finally:
            self.close_spool()

    async def _run(self, stop: asyncio.Event) -> None:
        try:
            await asyncio.to_thread(self.snapshots.ensure_instances, self.targets, self.clock())
        except StoreError as exc:
            log.warning("instances not recorded: %s", exc)
        cs = self.settings.collector
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            lifespan="off",
            access_log=False,
            **server_options(cs.header_timeout_s, cs.max_connections),
        )
        server = uvicorn.Server(config)
        server_task = asyncio.create_task(server.serve(sockets=[self.sock]))
        for name in (SCRAPER, SNAPSHOTS, MAINTENANCE, "span_writer"):
            self.health.beat(name)  # bounds count from now, not from construction
        tasks = [
            self._supervise(SCRAPER, (self.promsource or self.scraper).run(stop), stop),
            self._supervise("span_writer", self.batcher.run(stop), stop),
            self._supervise(MAINTENANCE, self._maintenance_loop(stop), stop),
        ]
        while not server.started and not server_task.done():  # noqa: ASYNC110 (uvicorn offers no event)
            await asyncio.sleep(0.01)
        self.started.set()
        log.info(
            "collector %s up on %s:%d: %d targets every %gs from %s, %s",
            self.id,
            self.settings.collector.host,
            self.port,
            len(self.targets),
            self.settings.collector.scrape_interval_s,
            self.promsource.url if self.promsource else "their /metrics",
            "shared with the live collectors of the store" if self.shard.membership else "alone (SQLite)",
        )
        try:
            await stop.wait()
        finally:
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._leave()
            server.should_exit = True
            await asyncio.gather(server_task, return_exceptions=True)
            await self.client.aclose()
            self.sock.close()
