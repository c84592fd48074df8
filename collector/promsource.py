"""Prometheus as a source: read the stored vLLM signals from an existing Prometheus.

For teams that already scrape vLLM: instead of fetching every instance's ``/metrics``,
the collector asks Prometheus (``/api/v1/query``, an instant query at the round's time)
for every family ``store.families.SPECS`` names, once per family per interval for the
whole fleet (never per instance), plus ``up``, ``scrape_duration_seconds``,
``process_start_time_seconds`` and one query for any other ``vllm:nixl_*`` series. The
answers are grouped by instance and folded with ``collector.signals.finish``, so a
snapshot holds what the scraper would have stored from the same page; each round comes
out as the scraper's ``ScrapeResult`` list and goes to the same store writer. With several
collectors on one store, each stores only the instances of its share (``assign``,
``collector.membership``); the queries still cover the whole fleet.

Which Prometheus series belong to which pdscope instance: the value of one label
(``collector.prometheus_instance_label``, default ``instance``) must equal either the
pdscope instance name (the shipped deploy/prometheus config sets ``instance`` to it) or
the ``host:port`` of the instance's metrics URL (Prometheus's default ``instance``;
ports 80/443 are implied by http/https). The name wins when both could match. Series of
no configured instance are ignored. ``collector.prometheus_selector`` (e.g. ``job="vllm"``)
is added to every query so other jobs' series never count; when an instance's series still
come from several ``job`` values, only the job with the most vLLM series is used and the
snapshot's error says so (two jobs scraping one vLLM would double every sum).

``up`` is Prometheus's ``up`` for that target: 0 gives a down snapshot, and an instance
with no series at all is down with an error that says so. When the ``up`` series is
missing but vLLM series are there (federated or remote-written data), the instance is up.
A Prometheus that cannot be reached, answers an HTTP error, bad JSON or an error status,
or does not answer every query within ``scrape_timeout_s``, makes the whole round a down
snapshot for every instance with that reason; ``pdscope_collector_prometheus_up`` says
so on the collector's /metrics. Nothing here raises out of a round.

It must not write to the store itself nor know about the receiver or the controller.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from collector.scraper import Scraper, ScrapeResult
from collector.signals import HistogramAcc, Signals, finish
from collector.targets import ScrapeTarget
from store.families import ALIASES, ENGINE_FAMILY, NIXL_PREFIX, PROCESS_START, SPEC_BY_FAMILY, SPECS, Spec

log = logging.getLogger(__name__)

UP = "up"
SCRAPE_DURATION = "scrape_duration_seconds"
_HIST_SUFFIXES = ("_bucket", "_sum", "_count")
_CONCURRENCY = 8


class PromError(Exception):
    """Prometheus did not answer a query usefully; the message says why."""


@dataclass(frozen=True)
class Series:
    name: str
    labels: dict[str, str]
    value: float


def _names_of(family: str) -> list[str]:
    return [family, *(old for old, new in ALIASES.items() if new == family)]


def build_queries(selector: str = "") -> list[str]:
    """The round's PromQL: one vector selector per stored family, plus up, durations, starts."""
    extra = f",{selector.strip().strip(',')}" if selector.strip() else ""
    queries = []
    for spec in SPECS:
        names = "|".join(_names_of(spec.family))
        regex = f"({names})_(bucket|sum|count)" if spec.kind == "histogram" else names
        queries.append(f'{{__name__=~"{regex}"{extra}}}')
    known_nixl = "|".join(
        s.family + (".*" if s.kind == "histogram" else "") for s in SPECS if s.family.startswith(NIXL_PREFIX)
    )
    queries.append(f'{{__name__=~"{NIXL_PREFIX}.*",__name__!~"{known_nixl}|.*_created"{extra}}}')
    for name in (PROCESS_START, UP, SCRAPE_DURATION):
        queries.append(f'{{__name__="{name}"{extra}}}')
    return queries


def _is_histogram(base: str) -> bool:
    spec = SPEC_BY_FAMILY.get(ALIASES.get(base, base))
    return spec is not None and spec.kind == "histogram"


def _family_of(name: str, bucket_bases: set[str]) -> tuple[str, str | None]:
    """(family, histogram suffix or None) of one series name."""
    for suffix in _HIST_SUFFIXES:
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            if base in bucket_bases or _is_histogram(base):
                return base, suffix
    return name, None


def signals_from_series(series: Iterable[Series]) -> Signals:
    """One instance's series (as Prometheus answers them) folded like a scraped page."""
    items = [s for s in series if s.name not in (UP, SCRAPE_DURATION)]
    signals = Signals()
    scalars: dict[str, list[float]] = {}
    hists: dict[str, HistogramAcc] = {}
    engines: set[str] = set()
    bucket_bases = {s.name[: -len("_bucket")] for s in items if s.name.endswith("_bucket")}
    resolved = [(s, *_family_of(s.name, bucket_bases)) for s in items]
    present = {family for _, family, _ in resolved}
    for s, family, suffix in resolved:
        if family == PROCESS_START:
            signals.process_start_ts = s.value
            continue
        if family in ALIASES:
            if ALIASES[family] in present:
                continue
            family = ALIASES[family]
        spec = SPEC_BY_FAMILY.get(family)
        if spec is None:
            if not family.startswith(NIXL_PREFIX) or family.endswith("_created"):
                continue
            spec = Spec(family, "histogram" if suffix else "scalar", column=family)
        if spec.kind == "histogram":
            acc = hists.setdefault(family, HistogramAcc())
            if suffix == "_bucket":
                try:
                    acc.add_bucket(float(s.labels.get("le", "")), s.value)
                except ValueError:
                    signals.errors.append(f"{family}: bad le {s.labels.get('le')!r}")
            elif suffix == "_sum":
                acc.add_sum(s.value)
            elif suffix == "_count":
                acc.add_count(s.value)
            continue
        if spec.kind == "labelled":
            col = dict(spec.columns).get(s.labels.get(spec.label or "", ""))
            if col is not None:
                scalars.setdefault(col, []).append(s.value)
            continue
        scalars.setdefault(spec.column or family, []).append(s.value)
        if family == ENGINE_FAMILY:
            engines.add(s.labels.get("engine", ""))
    if engines:
        signals.engines = len(engines)
    return finish(signals, scalars, hists)


def host_port(url: str) -> str:
    """``host:port`` as Prometheus's default ``instance`` label spells a scrape URL."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_answer(body: bytes) -> list[Series]:
    """Series of one ``/api/v1/query`` answer (a vector). Raises PromError."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise PromError(f"bad JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("status") != "success":
        detail = doc.get("error") if isinstance(doc, dict) else None
        raise PromError(f"query failed: {detail or 'no success status'}"[:300])
    data = doc.get("data")
    if (
        not isinstance(data, dict)
        or data.get("resultType") != "vector"
        or not isinstance(data.get("result"), list)
    ):
        raise PromError("answer is not a vector")
    out = []
    try:
        for item in data["result"]:
            labels = dict(item["metric"])
            name = labels.pop("__name__")
            out.append(Series(name, labels, float(item["value"][1])))
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise PromError(f"malformed vector sample: {exc!r}") from exc
    return out


def _one_job(series: list[Series]) -> tuple[list[Series], str | None]:
    """One instance's series from a single ``job``: two jobs scraping the same vLLM would
    double every sum. Keeps the job with the most vLLM series and says so."""
    jobs: dict[str, int] = {}
    for s in series:
        jobs[s.labels.get("job", "")] = jobs.get(s.labels.get("job", ""), 0) + s.name.startswith("vllm:")
    if len(jobs) <= 1:
        return series, None
    keep = max(sorted(jobs), key=lambda job: jobs[job])
    note = f"series from jobs {sorted(jobs)}; kept {keep!r} (set collector.prometheus_selector)"
    return [s for s in series if s.labels.get("job", "") == keep], note


class PromSource(Scraper):
    """A scraper whose rounds come from Prometheus; ``run``'s cadence is the scraper's."""

    def __init__(
        self,
        targets: Sequence[ScrapeTarget],
        prometheus_url: str,
        *,
        interval_s: float,
        timeout_s: float,
        max_body_bytes: int,
        on_round: Callable[[list[ScrapeResult]], Coroutine[Any, Any, None]],
        instance_label: str = "instance",
        selector: str = "",
        registry: CollectorRegistry | None = None,
        client: httpx.AsyncClient | None = None,
        clock: Callable[[], float] = time.time,
        on_tick: Callable[[], None] | None = None,
        assign: Callable[[], Awaitable[Sequence[ScrapeTarget]]] | None = None,
    ) -> None:
        client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), follow_redirects=False)
        super().__init__(
            targets,
            client,
            interval_s=interval_s,
            timeout_s=timeout_s,
            max_body_bytes=max_body_bytes,
            on_round=on_round,
            jitter_s=0.0,
            on_tick=on_tick,
            assign=assign,
        )
        self.url = prometheus_url.rstrip("/")
        self.instance_label = instance_label
        self.queries = build_queries(selector)
        self.clock = clock
        by_name = {t.name: t for t in self.targets}
        by_addr = {host_port(t.metrics_url): t for t in self.targets}
        self._lookup = {**by_addr, **by_name}  # the name wins
        self.prom_up = Gauge(
            "pdscope_collector_prometheus_up",
            "1 if the last round's queries to Prometheus all succeeded",
            registry=registry,
        )
        self.prom_queries = Counter(
            "pdscope_collector_prometheus_queries",
            "Queries to Prometheus by result (a failed round counts one error)",
            ["result"],
            registry=registry,
        )
        self.last_error: str | None = None

    async def _query(self, sem: asyncio.Semaphore, expr: str, at: float) -> list[Series]:
        async with sem:
            chunks: list[bytes] = []
            size = 0
            try:
                async with self.client.stream(
                    "GET", f"{self.url}/api/v1/query", params={"query": expr, "time": f"{at:.3f}"}
                ) as response:
                    async for chunk in response.aiter_bytes():
                        size += len(chunk)
                        if size > self.max_body_bytes:
                            raise PromError(f"answer larger than {self.max_body_bytes} bytes")
                        chunks.append(chunk)
            except httpx.HTTPError as exc:
                raise PromError(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from exc
            body = b"".join(chunks)
            if response.status_code != 200:
                try:  # Prometheus explains its 4xx/5xx in a JSON body
                    detail = str(json.loads(body).get("error", ""))
                except (ValueError, UnicodeDecodeError, AttributeError):
                    detail = body[:200].decode("utf-8", "replace")
                raise PromError(f"HTTP {response.status_code}: {detail}".rstrip(": "))
            series = parse_answer(body)
        self.prom_queries.labels("ok").inc()
        return series

    async def fetch(self, at: float) -> list[Series]:
        """Every query of one round, concurrently, within ``timeout_s``. Raises PromError."""
        sem = asyncio.Semaphore(_CONCURRENCY)
        try:
            # a TaskGroup cancels the other queries as soon as one fails or time is up
            async with asyncio.timeout(self.timeout_s), asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._query(sem, q, at)) for q in self.queries]
        except TimeoutError as exc:
            self.prom_queries.labels("error").inc()
            raise PromError(f"no answer within {self.timeout_s:g}s") from exc
        except ExceptionGroup as group_exc:
            first = group_exc.exceptions[0]
            if not isinstance(first, PromError):
                raise
            self.prom_queries.labels("error").inc()
            raise PromError(str(first)) from group_exc
        return [s for task in tasks for s in task.result()]

    def results_for(self, series: Sequence[Series], ts: float, duration_s: float) -> list[ScrapeResult]:
        """One ScrapeResult per target from one round's series."""
        grouped: dict[str, list[Series]] = {t.name: [] for t in self.targets}
        for s in series:
            target = self._lookup.get(s.labels.get(self.instance_label, ""))
            if target is not None:
                grouped[target.name].append(s)
        out = []
        for t in self.targets:
            mine, note = _one_job(grouped[t.name])
            ups = [s.value for s in mine if s.name == UP]
            durations = [s.value for s in mine if s.name == SCRAPE_DURATION and math.isfinite(s.value)]
            took = durations[0] if durations else duration_s
            if ups and max(ups) < 1:
                out.append(ScrapeResult(t, ts, took, None, "Prometheus reports the target down (up == 0)"))
                continue
            signals = signals_from_series(mine)
            if not signals.values and not signals.histograms:
                error = (
                    f"no vLLM series in Prometheus for this instance ({self.instance_label}="
                    f"{t.name!r} or {host_port(t.metrics_url)!r})"
                    if not ups
                    else "Prometheus has the target up but no vLLM series for it"
                )
                out.append(ScrapeResult(t, ts, took, None, error))
                continue
            if note:
                signals.errors.insert(0, note)
            out.append(ScrapeResult(t, ts, took, signals, None))
        return out

    async def scrape_round(self) -> list[ScrapeResult]:
        ts = self.clock()
        start = time.perf_counter()
        try:
            series = await self.fetch(ts)
        except PromError as exc:
            self.prom_up.set(0.0)
            error = f"prometheus {self.url}: {exc}"[:500]
            if error != self.last_error:
                log.warning("%s", error)
            self.last_error = error
            took = time.perf_counter() - start
            return [ScrapeResult(t, ts, took, None, error) for t in self.targets]
        self.prom_up.set(1.0)
        self.last_error = None
        return self.results_for(series, ts, time.perf_counter() - start)

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await super().run(stop)
        finally:
            await self.client.aclose()
