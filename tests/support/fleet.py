"""A whole pdscope fleet as processes on 127.0.0.1, for the ``fleet`` tier and ``bench/fleet``.

:class:`Fleet` starts, each as a ``pdscope`` subprocess with a config file of its own (its own
``proxy.id`` / ``collector.id`` and ports; the same pools and store for all), a simulated vLLM
fleet (``pdscope sim``), N controllers, N collectors and N proxies sharing one store (PostgreSQL
in the tier), and waits until each answers (no fixed sleeps). Every process runs in a session of
its own and is stopped by its PID (SIGCONT, SIGTERM, then SIGKILL): nothing is left behind.
:class:`Service` is the launcher's child (:class:`pdscope.stack.Child`) with ``kill9`` / ``pause``
(SIGSTOP) / ``resume`` (SIGCONT) and its HTTP API.

:class:`Load` is the bounded client: open loop (seeded Poisson arrivals), round-robin over the
proxies it is given, bounded by a count and a duration, each request's outcome recorded
(:class:`Sent`). :class:`InflightSampler` sums a per-pool gauge across the proxies while it runs.

The harness only orchestrates and reads (HTTP, ``/metrics``, the store through SQLAlchemy); it
imports no service package, so it runs the code as deployed.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import random
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdscope.stack import Child, ChildGroup, Ready, StartError, answered, pdscope_argv, write_config
from tests.support.sockets import free_ports
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
TOKEN = "fleet-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MODEL = "sim-llama-70b"
KV_BYTES_PER_TOKEN = 327680
START_TIMEOUT_S = 60.0
HTTP_ERRORS = (httpx.HTTPError, ValueError, OSError)


def _proxy_fields() -> set[str]:
    """The fields ``proxy:`` takes in this tree (``controller_urls`` arrives with the failover)."""
    from pdscope.config import ProxySettings

    return set(ProxySettings.model_fields)


@dataclass(frozen=True)
class FleetShape:
    """What to start and how fast it turns. Intervals are short so a test sees several of each."""

    prefill: int = 2
    decode: int = 4
    proxies: int = 3
    controllers: int = 2
    collectors: int = 2
    interval_s: float = 0.5  # controller ticks; its lock lease is max(10 s, 5 intervals)
    scrape_interval_s: float = 0.5
    routing_poll_s: float = 0.25
    max_inflight_requests: int = 256  # each pool's limit (proxy.admission)
    queue_timeout_s: float = 1.0
    tracing: bool = True
    sim_tracing: bool = True  # the simulated vLLMs export llm_request spans (to the last collector)
    # naive: no controller is started and every proxy points at a dead one with expected_replicas 1,
    # so each admits the config's whole limit (the behaviour before apportioning)
    naive: bool = False
    seed: int = 0
    simulator: dict[str, Any] = field(default_factory=dict)
    controller: dict[str, Any] = field(default_factory=dict)
    # the proxy's own AIMD limit (on its TTFT) is off: on a shared 2-core machine CPU contention alone
    # would move it, and what these runs measure is the pools' configured (and apportioned) limits
    proxy: dict[str, Any] = field(default_factory=lambda: {"adaptive_limit": {"enabled": False}})
    collector: dict[str, Any] = field(default_factory=dict)


class Service(Child):
    """One child process, ``pdscope --config <its file> <command>`` (:class:`pdscope.stack.Child`),
    with the signals a test sends it and its HTTP API."""

    def __init__(
        self,
        name: str,
        kind: str,
        argv: list[str],
        url: str,
        health_path: str,
        log_path: Path,
        env: dict[str, str],
    ) -> None:
        super().__init__(name, argv, log_path, ready_url=url + health_path, env=env, cwd=REPO)
        self.kind = kind  # sim, collector, controller, proxy
        self.url = url  # base URL of its HTTP API
        self.health_path = health_path

    def kill9(self) -> None:
        """SIGKILL, and reap it: its sockets (and PostgreSQL sessions) close with it."""
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def tail(self, n: int = 30) -> str:
        return super().tail(n)

    def get(self, path: str, timeout_s: float = 2.0) -> httpx.Response:
        return httpx.get(self.url + path, timeout=timeout_s)

    def health(self) -> dict[str, Any]:
        """``/healthz`` as JSON, whatever its status code (a degraded service answers 503 with a body)."""
        body: dict[str, Any] = self.get(self.health_path).json()
        return body

    def metrics(self) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        """``/metrics`` parsed: sample name -> {sorted label pairs: value}."""
        return parse_metrics(self.get("/metrics", timeout_s=5.0).text)


def parse_metrics(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = float(s.value)
    return out


def by_label(samples: dict[tuple[tuple[str, str], ...], float], label: str) -> dict[str, float]:
    """One sample family keyed by one label's value (other labels summed)."""
    out: dict[str, float] = {}
    for labels, value in samples.items():
        key = dict(labels).get(label, "")
        out[key] = out.get(key, 0.0) + value
    return out


class Fleet:
    """``with Fleet(shape, store_url, workdir) as f:`` starts everything and waits until it answers."""

    def __init__(self, shape: FleetShape, store_url: str, workdir: Path) -> None:
        self.shape = shape
        self.store_url = store_url
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        n_inst = shape.prefill + shape.decode
        ports = free_ports(n_inst + 1 + shape.proxies + shape.controllers + shape.collectors + 1)
        self.instance_ports = ports[:n_inst]
        rest = ports[n_inst:]
        self.admin_port, rest = rest[0], rest[1:]
        self.proxy_ports, rest = rest[: shape.proxies], rest[shape.proxies :]
        self.controller_ports, rest = rest[: shape.controllers], rest[shape.controllers :]
        self.collector_ports, rest = rest[: shape.collectors], rest[shape.collectors :]
        self.dead_port = rest[0]  # nothing listens here: the naive proxies' controller
        self.prefills = [f"prefill-{i}" for i in range(shape.prefill)]
        self.decodes = [f"decode-{i}" for i in range(shape.decode)]
        self.instances = dict(
            zip(
                self.prefills + self.decodes,
                (f"http://127.0.0.1:{p}" for p in self.instance_ports),
                strict=True,
            )
        )
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "PDSCOPE_API_TOKEN": TOKEN}
        self.env.pop("PDSCOPE_OTLP_TOKENS", None)
        self.env.pop("PDSCOPE_OTLP_TOKEN", None)
        self.sim: Service = self._service("sim", "sim", self.admin_port, {}, "/instances")
        self.collectors = [
            self._service(f"collector-{i}", "collector", port, self._collector_cfg(i, port), "/healthz")
            for i, port in enumerate(self.collector_ports)
        ]
        self.controllers = [
            self._service(f"controller-{i}", "controller", port, {"controller": {"port": port}}, "/healthz")
            for i, port in enumerate(self.controller_ports)
        ]
        self.proxies = [
            self._service(f"proxy-{i}", "proxy", port, self._proxy_cfg(i, port), "/healthz")
            for i, port in enumerate(self.proxy_ports)
        ]
        self._engine: Any = None

    # -- configs ------------------------------------------------------------------------

    @property
    def collector_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.collector_ports]

    @property
    def controller_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.controller_ports]

    @property
    def proxy_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.proxy_ports]

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def base_config(self) -> dict[str, Any]:
        s = self.shape
        collectors = self.collector_urls
        first_controller = self.controller_urls[0] if s.controllers else f"http://127.0.0.1:{self.dead_port}"
        return {
            "model": {"name": MODEL, "kv_bytes_per_token": KV_BYTES_PER_TOKEN},
            "pools": {
                "prefill": {
                    "role": "prefill",
                    "instances": [{"name": n, "url": self.instances[n]} for n in self.prefills],
                },
                "decode": {
                    "role": "decode",
                    "instances": [{"name": n, "url": self.instances[n]} for n in self.decodes],
                },
            },
            "slo": {"ttft": {"target_ms": 2000}, "tpot": {"target_ms": 100}, "window_s": 30},
            "store": {"url": self.store_url},
            "simulator": {
                "seed": s.seed,
                "admin_port": self.admin_port,
                "tracing": s.sim_tracing and bool(collectors),
                **({"otlp_endpoint": f"{collectors[-1]}/v1/traces"} if collectors else {}),
                **s.simulator,
            },
            "collector": {
                "port": self.collector_ports[0] if collectors else 4318,
                "scrape_interval_s": s.scrape_interval_s,
                "scrape_timeout_s": 0.8 * s.scrape_interval_s,
                **s.collector,
            },
            "controller": {
                "port": self.controller_ports[0] if s.controllers else self.dead_port,
                "interval_s": s.interval_s,
                "window_s": 10.0,
                "mode": "enforce",
                "proxy_ttl_s": max(2.0, 4 * s.routing_poll_s),
                **s.controller,
            },
            "proxy": {
                "controller_url": first_controller,
                "routing_poll_s": s.routing_poll_s,
                "fail_static_s": 60.0,
                "tracing": s.tracing,
                "admission": {
                    "max_inflight_requests": s.max_inflight_requests,
                    "queue_timeout_s": s.queue_timeout_s,
                },
                "timeouts": {"prefill_s": 30, "decode_first_token_s": 30, "decode_total_s": 60},
                # one config for the whole fleet, as deploy/ ships it: the controller reads the proxies'
                # replica count too (without proxy credentials it is the number of seats it gives)
                **(
                    {"expected_replicas": max(1, s.proxies)} if "expected_replicas" in _proxy_fields() else {}
                ),
                **s.proxy,
            },
        }

    def _collector_cfg(self, i: int, port: int) -> dict[str, Any]:
        """Collector ``i``'s own port, id and spool (in the work folder, where a restart finds it again;
        the shape's ``spool_dir`` when it sets one)."""
        spool = self.shape.collector.get("spool_dir", str(self.workdir / f"collector-{i}-spool"))
        return {"collector": {"port": port, "id": f"collector-{i}", "spool_dir": spool}}

    def _proxy_cfg(self, i: int, port: int) -> dict[str, Any]:
        s = self.shape
        proxy: dict[str, Any] = {"port": port, "id": f"proxy-{i}"}
        if s.collectors:  # spread the proxies' spans over the collectors
            proxy["otlp_endpoint"] = f"{self.collector_urls[i % s.collectors]}/v1/traces"
        if s.naive:
            proxy["controller_url"] = f"http://127.0.0.1:{self.dead_port}"
            proxy["expected_replicas"] = 1
        elif "expected_replicas" in _proxy_fields():
            proxy["expected_replicas"] = s.proxies  # as a deployment of N proxies sets it
        elif "controller_urls" in _proxy_fields() and s.controllers:
            # every controller replica serves GET /v1/routing: each proxy starts at a different one
            urls = self.controller_urls
            proxy["controller_urls"] = urls[i % len(urls) :] + urls[: i % len(urls)]
            proxy["controller_url"] = None
        return {"proxy": proxy}

    def _service(self, name: str, kind: str, port: int, overlay: dict[str, Any], health: str) -> Service:
        cfg = self.base_config()
        for section, values in overlay.items():
            cfg[section] = {**cfg.get(section, {}), **values}
        if cfg.get("proxy", {}).get("controller_url", "") is None:
            del cfg["proxy"]["controller_url"]
        path = write_config(self.workdir / f"{name}.yaml", cfg)
        extra = ["--admin-port", str(port)] if kind == "sim" else []
        argv = pdscope_argv(path, kind_cmd(kind), *extra, log_level="INFO")
        return Service(
            name, kind, argv, f"http://127.0.0.1:{port}", health, self.workdir / f"{name}.log", self.env
        )

    def config_of(self, service: Service) -> dict[str, Any]:
        loaded: dict[str, Any] = yaml.safe_load((self.workdir / f"{service.name}.yaml").read_text())
        return loaded

    # -- life cycle ---------------------------------------------------------------------

    @property
    def services(self) -> list[Service]:
        return [self.sim, *self.collectors, *self.controllers, *self.proxies]

    def __enter__(self) -> Fleet:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        from store.migrate import upgrade

        upgrade(self.store_url)  # once, before the services that share the store
        self._start_and_wait([self.sim], _ok)
        self._start_and_wait(self.collectors, _ok)
        if self.controllers:
            self._start_and_wait(self.controllers, _has_role)
            self.wait_for_leader()
        self._start_and_wait(self.proxies, _ok)
        if self.controllers:
            wait_until(
                "every proxy to apply a table from the controller",
                lambda: [p.health().get("routing") for p in self.proxies],
                done=lambda states: all(st == "fresh" for st in states),
                timeout_s=START_TIMEOUT_S,
                every_s=0.1,
                ignore=HTTP_ERRORS,
            )

    def _start_and_wait(self, group: Sequence[Service], ready: Ready) -> None:
        for s in group:
            s.start()
        for s in group:
            self.wait_ready(s, ready)

    def wait_ready(self, s: Service, ready: Ready, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until ``ready`` holds for its health path's answer; an AssertionError with its log when it
        exits first or the deadline passes."""
        try:
            s.wait_ready(timeout_s, ready=ready, every_s=0.1)
        except StartError as exc:
            raise AssertionError(str(exc)) from None

    def restart(self, s: Service) -> None:
        """Start a stopped (killed) service again on the same config and wait until it answers."""
        s.stop()
        s.start()
        self.wait_ready(s, lambda r: answered(r) or _has_role(r))

    def close(self) -> None:
        ChildGroup(self.services).stop()
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    # -- reading the fleet --------------------------------------------------------------

    def roles(self) -> dict[str, dict[str, Any]]:
        """Each live controller's ``/healthz`` (name -> body); an unreachable one is left out."""
        out = {}
        for c in self.controllers:
            if not c.alive():
                continue
            with contextlib.suppress(*HTTP_ERRORS):
                out[c.name] = c.health()
        return out

    def leader(self) -> Service | None:
        roles = self.roles()
        leaders = [c for c in self.controllers if roles.get(c.name, {}).get("role") == "leader"]
        return leaders[0] if len(leaders) == 1 else None

    def wait_for_leader(self, timeout_s: float = START_TIMEOUT_S, not_: Service | None = None) -> Service:
        leader = wait_until(
            "one controller to lead" + (f" other than {not_.name}" if not_ else ""),
            self.leader,
            done=lambda c: c is not None and c is not not_ and c.health().get("ticks", 0) > 0,
            timeout_s=timeout_s,
            every_s=0.05,
            ignore=HTTP_ERRORS,
        )
        assert leader is not None
        return leader

    def engine(self) -> Any:
        if self._engine is None:
            from sqlalchemy.pool import NullPool

            from store.db import make_engine

            self._engine = make_engine(self.store_url, poolclass=NullPool)
        return self._engine

    def query(self, sql: str, **params: Any) -> list[tuple[Any, ...]]:
        """Rows of one SQL query on the store (a new connection each time: survives a restart)."""
        from sqlalchemy import text

        with self.engine().connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql), params)]

    def post_controller(
        self, c: Service, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> httpx.Response:
        return httpx.post(c.url + path, json=body, headers={**AUTH, **(headers or {})}, timeout=5)


def _ok(response: httpx.Response) -> bool:
    return response.status_code == 200


def _has_role(response: httpx.Response) -> bool:
    """A controller's ``/healthz`` names its role (leader or standby) once it runs, whatever its status."""
    return "role" in response.json()


def kind_cmd(kind: str) -> str:
    return {"sim": "sim", "collector": "collect", "controller": "control", "proxy": "proxy"}[kind]


# -- the client --------------------------------------------------------------------------


@dataclass
class Sent:
    """One client request: which proxy, when (monotonic seconds), and how it ended."""

    index: int
    proxy: str
    sent: float
    ended: float = 0.0
    status: int | None = None  # HTTP status; None: no answer (error says why)
    error: str | None = None
    request_id: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


class Load:
    """Open-loop client: seeded Poisson arrivals at ``rate`` per second, round-robin over the proxies,
    at most ``max_requests`` sent and none after ``duration_s``. Runs in a thread of its own with an
    event loop; :meth:`exclude` takes a proxy out of the rotation (a load balancer's health check)."""

    def __init__(
        self,
        proxies: Sequence[str],
        *,
        rate: float,
        max_requests: int,
        duration_s: float,
        prompt_tokens: int = 64,
        max_tokens: int = 16,
        seed: int = 1,
        request_timeout_s: float = 30.0,
    ) -> None:
        assert rate > 0 and max_requests > 0 and duration_s > 0
        self.proxies = list(proxies)
        self.excluded: set[str] = set()
        self.rate, self.max_requests, self.duration_s = rate, max_requests, duration_s
        # Every prompt starts with its own number, so no two share a cached prefix (the simulator caches
        # prefixes like vLLM: a repeated prompt would make P's prefill and D's pull nearly free).
        self.prompt_tokens, self.max_tokens = prompt_tokens, max_tokens
        self.rng = random.Random(seed)
        self.timeout_s = request_timeout_s
        self.results: list[Sent] = []
        self.started = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="fleet-load", daemon=True)
        self.t0 = 0.0
        self.error: BaseException | None = None

    def __enter__(self) -> Load:
        self._thread.start()
        self.started.wait(10)
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:  # the test failed: stop sending, let what is in flight end
            self._stop.set()
        self.join()

    def exclude(self, url: str) -> None:
        self.excluded.add(url)

    def stop(self) -> None:
        """Send nothing more (the requests in flight still finish)."""
        self._stop.set()

    def join(self, timeout_s: float | None = None) -> list[Sent]:
        self._thread.join(timeout_s if timeout_s is not None else self.duration_s + self.timeout_s + 30)
        if self.error is not None:
            raise AssertionError(f"the load generator failed: {self.error!r}")
        return self.results

    def done(self) -> bool:
        return not self._thread.is_alive()

    def sent_since(self, t: float) -> list[Sent]:
        return [r for r in list(self.results) if r.sent >= t]

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as exc:  # reported by join()
            self.error = exc

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits) as client:
            tasks: list[asyncio.Task[None]] = []
            self.t0 = time.monotonic()
            self.started.set()
            end = self.t0 + self.duration_s
            next_at = self.t0
            turn = 0
            while len(tasks) < self.max_requests and not self._stop.is_set():
                now = time.monotonic()
                if next_at >= end:
                    break
                if next_at > now:
                    await asyncio.sleep(next_at - now)
                live = [p for p in self.proxies if p not in self.excluded]
                if not live:
                    break
                proxy = live[turn % len(live)]
                turn += 1
                rec = Sent(len(tasks), proxy, time.monotonic())
                self.results.append(rec)
                tasks.append(asyncio.create_task(self._one(client, rec)))
                next_at += self.rng.expovariate(self.rate)
            await asyncio.gather(*tasks)

    async def _one(self, client: httpx.AsyncClient, rec: Sent) -> None:
        try:
            prompt = " ".join([f"req{rec.index}", *["hi"] * (self.prompt_tokens - 1)])
            body = {"model": MODEL, "prompt": prompt, "max_tokens": self.max_tokens}
            r = await client.post(rec.proxy + "/v1/completions", json=body)
            rec.status = r.status_code
            if r.status_code != 200:
                rec.error = r.text[:200]
            rec.request_id = r.headers.get("x-request-id")
        except httpx.HTTPError as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        rec.ended = time.monotonic()


def summarize(results: Sequence[Sent]) -> str:
    """A failure message's evidence: counts by proxy and outcome, and the first few failures."""
    counts: dict[tuple[str, str], int] = {}
    for r in results:
        key = (r.proxy, "ok" if r.ok else f"{r.status}")
        counts[key] = counts.get(key, 0) + 1
    bad = [r for r in results if not r.ok][:5]
    return f"{len(results)} sent; {dict(sorted(counts.items()))}; first failures: " + "; ".join(
        f"#{r.index} {r.proxy} at {r.sent:.2f}: {r.status} {r.error}" for r in bad
    )


# -- in-flight sampling ------------------------------------------------------------------


class InflightSampler:
    """Sums ``gauge{pool}`` across the proxies every ``every_s`` in a thread (each proxy read in
    parallel, so the sum is of nearly one moment); keeps every sum, per pool, and each proxy's
    reading and request limit in force (``pdscope_proxy_pool_limit{kind="requests"}``, where exported)."""

    def __init__(
        self,
        proxies: Sequence[Service],
        gauge: str = "pdscope_proxy_pool_inflight_requests",
        every_s: float = 0.05,
    ) -> None:
        self.proxies = list(proxies)
        self.gauge = gauge
        self.every_s = every_s
        # (monotonic time, pool -> sum, proxy -> pool -> value, proxy -> pool -> its request limit)
        self.samples: list[
            tuple[float, dict[str, float], dict[str, dict[str, float]], dict[str, dict[str, float]]]
        ] = []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.proxies)))
        self._thread = threading.Thread(target=self._main, name="fleet-inflight", daemon=True)
        self.failures = 0

    def __enter__(self) -> InflightSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._pool.shutdown(wait=True)

    def _read(self, s: Service) -> tuple[dict[str, float], dict[str, float]] | None:
        if not s.alive():
            return None
        try:
            m = s.metrics()
        except HTTP_ERRORS:
            return None
        limits = {
            dict(labels).get("pool", ""): v
            for labels, v in m.get("pdscope_proxy_pool_limit", {}).items()
            if dict(labels).get("kind") == "requests"
        }
        return by_label(m.get(self.gauge, {}), "pool"), limits

    def _main(self) -> None:
        while not self._stop.is_set():
            per = list(self._pool.map(self._read, self.proxies))
            t = time.monotonic()
            total: dict[str, float] = {}
            each: dict[str, dict[str, float]] = {}
            limits: dict[str, dict[str, float]] = {}
            for s, got in zip(self.proxies, per, strict=True):
                if got is None:
                    self.failures += s.alive()
                    continue
                each[s.name], limits[s.name] = got
                for pool, v in got[0].items():
                    total[pool] = total.get(pool, 0.0) + v
            self.samples.append((t, total, each, limits))
            self._stop.wait(self.every_s)

    def peak(self, pool: str, since: float = 0.0) -> float:
        return max((tot.get(pool, 0.0) for t, tot, _, _ in self.samples if t >= since), default=0.0)

    def at_peak(self, pool: str) -> tuple[float, dict[str, float], dict[str, float]] | None:
        """The sample with the largest sum for ``pool``: (sum, each proxy's count, each proxy's limit)."""
        if not self.samples:
            return None
        _, tot, each, limits = max(self.samples, key=lambda x: x[1].get(pool, 0.0))
        return (
            tot.get(pool, 0.0),
            {k: v.get(pool, 0.0) for k, v in each.items()},
            {k: v.get(pool, 0.0) for k, v in limits.items() if pool in v},
        )

    def limit_sum_peak(self, pool: str) -> float | None:
        """The largest sum of the proxies' request limits for ``pool`` seen (None: not exported)."""
        sums = [sum(lim[pool] for lim in limits.values() if pool in lim) for *_, limits in self.samples]
        seen = [
            x
            for x, (*_, limits) in zip(sums, self.samples, strict=True)
            if any(pool in v for v in limits.values())
        ]
        return max(seen) if seen else None


@contextlib.contextmanager
def running(shape: FleetShape, store_url: str, workdir: Path) -> Iterator[Fleet]:
    with Fleet(shape, store_url, workdir) as f:
        yield f


def fleet_copy(shape: FleetShape, **changes: Any) -> FleetShape:
    """``shape`` with some fields changed (dict fields merged, not replaced)."""
    merged = {}
    for k, v in changes.items():
        old = getattr(shape, k)
        merged[k] = {**copy.deepcopy(old), **v} if isinstance(old, dict) else v
    from dataclasses import replace

    return replace(shape, **merged)
