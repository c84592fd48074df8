"""Prometheus as a source: the same snapshots as the scraper, one query per family, clear errors.

The unit tests run a fake Prometheus HTTP API (``/api/v1/query`` answering vector results
built from the real vLLM captures parsed by ``collector.parse.parse_text``, with the labels
Prometheus adds) on a free loopback port. The ``promtool`` test starts Debian's real
Prometheus scraping a simulated fleet and runs the collector against it.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import select

from collector.fastparse import extract_signals
from collector.parse import parse_text
from collector.promsource import PromSource, Series, build_queries, host_port, signals_from_series
from collector.scraper import ScrapeResult
from collector.service import CollectorService
from collector.snapshot_store import SnapshotStore
from collector.targets import ScrapeTarget
from pdscope.config import parse_config
from store.db import make_engine, session_factory
from store.families import SPECS
from store.migrate import upgrade
from store.models import Snapshot
from tests.captures import SCRAPE_PAGES
from tests.support.sockets import closed_port_url
from tests.support.waiting import async_wait_until, wait_until

FIXTURES = SCRAPE_PAGES
DECODE = (FIXTURES / "decode_metrics.txt").read_text()
PREFILL = (FIXTURES / "prefill_metrics.txt").read_text()
_MATCHER = re.compile(r'([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def series_of(page: str, **target_labels: str) -> list[dict[str, Any]]:
    """A page's samples as Prometheus stores them: the page's labels plus the target's."""
    out = []
    for fam in parse_text(page).families.values():
        for s in fam.samples:
            out.append({"metric": {"__name__": s.name, **s.labels, **target_labels}, "value": s.value})
    return out


def _matcher(selector: str) -> Callable[..., bool]:
    """A PromQL vector selector's label matchers as a predicate (what the fake evaluates)."""
    inner = selector.strip()
    assert inner.startswith("{") and inner.endswith("}"), selector
    tests = []
    for label, op, value in _MATCHER.findall(inner[1:-1]):
        rx = re.compile(value)
        tests.append((label, op, value, rx))

    def match(metric: dict[str, str], names_only: bool = False) -> bool:
        for label, op, value, rx in tests:
            if names_only and label != "__name__":
                continue
            have = metric.get(label, "")
            ok = {
                "=": have == value,
                "!=": have != value,
                "=~": rx.fullmatch(have) is not None,
                "!~": rx.fullmatch(have) is None,
            }[op]
            if not ok:
                return False
        return True

    return match


def _fmt(value: float) -> str:
    return {float("inf"): "+Inf", float("-inf"): "-Inf"}.get(value, "NaN" if value != value else repr(value))


class FakePrometheus:
    """``/api/v1/query`` over a fixed list of series; ``mode`` makes it misbehave."""

    def __init__(self) -> None:
        self.series: list[dict[str, Any]] = []
        self.mode = "ok"  # ok | 500 | badjson | error | slow
        self.queries: list[dict[str, str]] = []
        self.server: asyncio.Server | None = None
        self.url = ""

    def answer(self, query: str) -> dict[str, Any]:
        match = _matcher(query)
        by_name: dict[str, list[dict[str, Any]]] = {}
        for s in self.series:
            by_name.setdefault(s["metric"]["__name__"], []).append(s)
        names = [n for n in by_name if match({"__name__": n}, names_only=True)]  # cheap first pass
        now = time.time()
        result = [
            {"metric": s["metric"], "value": [now, _fmt(s["value"])]}
            for n in names
            for s in by_name[n]
            if match(s["metric"])
        ]
        return {"status": "success", "data": {"resultType": "vector", "result": result}}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                target = head.split(b" ", 2)[1].decode()
                params = {k: v[0] for k, v in parse_qs(urlsplit(target).query).items()}
                self.queries.append(params)
                status, body = 200, b""
                if self.mode == "slow":
                    await asyncio.sleep(5)  # the behaviour under test: a Prometheus slower than the timeout
                if self.mode == "500":
                    status, body = 500, b'{"status":"error","errorType":"internal","error":"out of memory"}'
                elif self.mode == "badjson":
                    body = b"<html>not json"
                elif self.mode == "error":
                    status, body = 400, b'{"status":"error","errorType":"bad_data","error":"parse error"}'
                else:
                    assert urlsplit(target).path == "/api/v1/query"
                    body = json.dumps(self.answer(params["query"])).encode()
                writer.write(
                    b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                    % (status, len(body))
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def fake_prom() -> AsyncIterator[FakePrometheus]:
    fake = FakePrometheus()
    fake.server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    fake.url = f"http://127.0.0.1:{fake.server.sockets[0].getsockname()[1]}"
    yield fake
    fake.server.close()


def _dead_url() -> str:
    return closed_port_url()


D0 = ScrapeTarget("d0", "decode", "decode", "http://10.0.0.7:8200", "http://10.0.0.7:8200/metrics")
P0 = ScrapeTarget("p0", "prefill", "prefill", "http://10.0.0.5:8100", "http://10.0.0.5:8100/metrics")
GONE = ScrapeTarget("gone", "decode", "decode", "http://10.0.0.9:8200", "http://10.0.0.9:8200/metrics")


def _fleet(fake: FakePrometheus) -> None:
    """d0 labelled by its pdscope name, p0 by host:port (Prometheus's default), one other job."""
    fake.series = (
        series_of(DECODE, instance="d0", job="vllm", pool="decode", role="decode")
        + series_of(PREFILL, instance="10.0.0.5:8100", job="vllm", pool="prefill", role="prefill")
        + [
            {"metric": {"__name__": "up", "instance": "d0", "job": "vllm"}, "value": 1.0},
            {"metric": {"__name__": "up", "instance": "10.0.0.5:8100", "job": "vllm"}, "value": 1.0},
            {
                "metric": {"__name__": "scrape_duration_seconds", "instance": "d0", "job": "vllm"},
                "value": 0.012,
            },
            # another job's series on the same instance label: the selector keeps them out
            {
                "metric": {"__name__": "vllm:num_requests_running", "instance": "d0", "job": "other"},
                "value": 99.0,
            },
        ]
    )


def _source(fake: FakePrometheus, targets: list[ScrapeTarget], **kw: Any) -> PromSource:
    async def ignore(results: list[ScrapeResult]) -> None:
        return None

    kw.setdefault("selector", 'job="vllm"')
    kw.setdefault("timeout_s", 2.0)
    return PromSource(targets, fake.url, interval_s=3.0, max_body_bytes=8 * 2**20, on_round=ignore, **kw)


def _rows(store_url: str, results: list[ScrapeResult]) -> dict[str, dict[str, Any]]:
    upgrade(store_url)
    store = SnapshotStore(session_factory(make_engine(store_url)))
    store.write_round(results)
    with store.factory() as s:
        snaps = list(s.scalars(select(Snapshot)))
    skip = {"id", "ts", "scrape_duration_s"}
    return {
        snap.instance: {
            c.name: getattr(snap, c.name) for c in Snapshot.__table__.columns if c.name not in skip
        }
        for snap in snaps
    }


def test_queries_are_one_per_family_with_the_selector() -> None:
    queries = build_queries('job="vllm"')
    assert len(queries) == len(SPECS) + 4  # + other nixl series, process start, up, scrape duration
    assert len(set(queries)) == len(queries)
    assert all(q.endswith(',job="vllm"}') for q in queries)
    assert '{__name__=~"(vllm:time_to_first_token_seconds)_(bucket|sum|count)",job="vllm"}' in queries
    assert '{__name__=~"vllm:kv_cache_usage_perc|vllm:gpu_cache_usage_perc",job="vllm"}' in queries
    assert build_queries()[-2] == '{__name__="up"}'


def test_host_port_is_prometheus_default_instance_label() -> None:
    assert host_port("http://10.0.0.5:8100/metrics") == "10.0.0.5:8100"
    assert host_port("http://vllm-p0/metrics") == "vllm-p0:80"
    assert host_port("https://vllm-p0/metrics") == "vllm-p0:443"
    assert host_port("http://[::1]:9000/metrics") == "[::1]:9000"


def _variant_pages() -> list[str]:
    two_engines = "".join(  # each engine-0 sample followed by an engine-1 twin
        line + "\n" + (line.replace('engine="0"', 'engine="1"') + "\n" if 'engine="0"' in line else "")
        for line in DECODE.splitlines()
    )
    new_nixl = DECODE + (
        '# TYPE vllm:nixl_new_thing_total counter\nvllm:nixl_new_thing_total{engine="0"} 7.0\n'
        "# TYPE vllm:nixl_wait_seconds histogram\n"
        'vllm:nixl_wait_seconds_bucket{engine="0",le="0.1"} 2.0\n'
        'vllm:nixl_wait_seconds_bucket{engine="0",le="+Inf"} 3.0\n'
        'vllm:nixl_wait_seconds_count{engine="0"} 3.0\nvllm:nixl_wait_seconds_sum{engine="0"} 0.9\n'
    )
    old_names = DECODE.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    return [DECODE, PREFILL, two_engines, new_nixl, old_names]


@pytest.mark.parametrize(
    "page", _variant_pages(), ids=["decode", "prefill", "2-engines", "new-nixl", "old-names"]
)
def test_series_fold_like_the_scraped_page(page: str) -> None:
    series = [
        Series(s["metric"]["__name__"], {k: v for k, v in s["metric"].items() if k != "__name__"}, s["value"])
        for s in series_of(page, instance="x", job="vllm")
    ]
    got, want = signals_from_series(series), extract_signals(page)
    assert got.values == pytest.approx(want.values)
    assert got.histograms == want.histograms
    assert got.extra == pytest.approx(want.extra)
    assert (got.engines, got.process_start_ts, got.errors) == (
        want.engines,
        want.process_start_ts,
        want.errors,
    )
    assert got.values  # not vacuous


async def test_stored_snapshots_equal_the_scraper_path(fake_prom: FakePrometheus, tmp_path: Path) -> None:
    _fleet(fake_prom)
    source = _source(fake_prom, [D0, P0, GONE])
    try:
        results = await source.scrape_round()
    finally:
        await source.client.aclose()
    by_name = {r.target.name: r for r in results}
    assert by_name["d0"].up and by_name["p0"].up and not by_name["gone"].up
    assert by_name["d0"].duration_s == 0.012  # Prometheus's scrape_duration_seconds
    assert "no vLLM series in Prometheus" in (by_name["gone"].error or "")
    assert "'10.0.0.9:8200'" in (by_name["gone"].error or "")
    # one query per family for the whole fleet, at the round's time, not one per instance
    assert len(fake_prom.queries) == len(build_queries())
    assert len({q["time"] for q in fake_prom.queries}) == 1

    scraped = [
        ScrapeResult(D0, 1.0, 0.01, extract_signals(DECODE), None),
        ScrapeResult(P0, 1.0, 0.01, extract_signals(PREFILL), None),
    ]
    from_prom = _rows(f"sqlite:///{tmp_path / 'prom.db'}", results)
    from_scrape = _rows(f"sqlite:///{tmp_path / 'scrape.db'}", scraped)
    for name in ("d0", "p0"):
        assert from_prom[name] == from_scrape[name], name
    assert from_prom["d0"]["nixl_xfer_time_count"] == 23.0 and from_prom["d0"]["num_running"] is not None
    assert from_prom["d0"]["histograms"]["vllm:nixl_xfer_time_seconds"]["counts"][-1] == 23.0
    assert from_prom["gone"]["up"] is False and from_prom["gone"]["kv_cache_usage"] is None


async def test_instance_label_is_configurable(fake_prom: FakePrometheus) -> None:
    fake_prom.series = [
        *series_of(DECODE, pdscope_instance="d0", instance="pod-1:8000", job="vllm"),
        {"metric": {"__name__": "up", "pdscope_instance": "d0", "job": "vllm"}, "value": 0.0},
    ]
    source = _source(fake_prom, [D0], instance_label="pdscope_instance", selector="")
    try:
        (down,) = await source.scrape_round()
        fake_prom.series[-1]["value"] = 1.0
        (up,) = await source.scrape_round()
    finally:
        await source.client.aclose()
    assert not down.up and down.error == "Prometheus reports the target down (up == 0)"
    assert up.up and up.signals is not None and up.signals.values["requests_length"] == 23.0


async def test_two_jobs_on_one_instance_are_not_summed(fake_prom: FakePrometheus) -> None:
    fake_prom.series = [
        *series_of(DECODE, instance="d0", job="vllm"),
        *series_of(DECODE, instance="d0", job="vllm-copy"),
        {"metric": {"__name__": "up", "instance": "d0", "job": "vllm"}, "value": 1.0},
        {"metric": {"__name__": "up", "instance": "d0", "job": "vllm-copy"}, "value": 1.0},
    ]
    source = _source(fake_prom, [D0], selector="")
    try:
        (res,) = await source.scrape_round()
    finally:
        await source.client.aclose()
    want = extract_signals(DECODE)
    assert res.signals is not None and res.signals.values == want.values
    assert res.signals.histograms == want.histograms
    assert res.signals.errors == [
        "series from jobs ['vllm', 'vllm-copy']; kept 'vllm' (set collector.prometheus_selector)"
    ]


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("down", "ConnectError"),
        ("500", "HTTP 500: out of memory"),
        ("badjson", "bad JSON"),
        ("error", "HTTP 400: parse error"),
        ("slow", "no answer within 0.5s"),
    ],
)
async def test_prometheus_failures_mark_every_instance(
    fake_prom: FakePrometheus, mode: str, reason: str
) -> None:
    _fleet(fake_prom)
    registry = CollectorRegistry()
    source = _source(fake_prom, [D0, P0], registry=registry, timeout_s=0.5 if mode == "slow" else 2.0)
    if mode == "down":
        source.url = _dead_url()
    else:
        fake_prom.mode = mode
    try:
        results = await source.scrape_round()
        assert registry.get_sample_value("pdscope_collector_prometheus_up") == 0.0
        fake_prom.mode, source.url = "ok", fake_prom.url
        recovered = await source.scrape_round()
    finally:
        await source.client.aclose()
    # "slow" is cut by the round's timeout: it would have answered (and been up) after 5 s
    assert [r.up for r in results] == [False, False]
    for r in results:
        assert r.error is not None and r.error.startswith(
            f"prometheus {fake_prom.url if mode != 'down' else ''}"
        )
        assert reason in r.error, r.error
    assert [r.up for r in recovered] == [True, True]
    assert registry.get_sample_value("pdscope_collector_prometheus_up") == 1.0
    assert (
        registry.get_sample_value("pdscope_collector_prometheus_queries_total", {"result": "error"}) or 0
    ) >= 1


def _config(fake_url: str, store: str, d_url: str = "http://10.0.0.7:8200") -> str:
    return f"""
model: {{name: tiny, kv_bytes_per_token: 1024}}
pools:
  prefill: {{role: prefill, instances: [{{name: p0, url: "http://10.0.0.5:8100"}}]}}
  decode: {{role: decode, instances: [{{name: d0, url: "{d_url}"}}]}}
store: {{url: "{store}"}}
collector: {{scrape_interval_s: 1.0, scrape_timeout_s: 0.8, prometheus_url: "{fake_url}",
             prometheus_selector: 'job="vllm"'}}
"""


async def test_service_in_prometheus_mode(fake_prom: FakePrometheus, tmp_path: Path) -> None:
    """The collector process reads Prometheus, stores through the snapshot store, and its own
    /metrics shows Prometheus going away; the OTLP receiver keeps serving."""
    _fleet(fake_prom)
    url = f"sqlite:///{tmp_path / 'c.db'}"
    upgrade(url)
    service = CollectorService(parse_config(_config(fake_prom.url, url)), port=0)
    assert service.promsource is not None
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        await asyncio.wait_for(service.started.wait(), timeout=10)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{service.port}", timeout=5) as client:

            async def page() -> str:
                return (await client.get("/metrics")).text

            up = (
                "pdscope_collector_prometheus_up 1.0",
                'pdscope_collector_target_up{instance="d0",pool="decode",role="decode"} 1.0',
            )
            await async_wait_until(
                "/metrics to show Prometheus and d0 up",
                page,
                done=lambda text: all(line in text for line in up),
            )
            fake_prom.mode = "500"
            down = (
                "pdscope_collector_prometheus_up 0.0",
                'pdscope_collector_target_up{instance="d0",pool="decode",role="decode"} 0.0',
                "HTTP 500: out of memory",
            )  # the last error, per target
            await async_wait_until(
                "/metrics to show Prometheus and d0 down with the error",
                page,
                done=lambda text: all(line in text for line in down),
            )
            traces = await client.post(
                "/v1/traces", content=b"", headers={"content-type": "application/x-protobuf"}
            )
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)
    assert traces.status_code < 500
    with service.factory() as s:
        snaps = list(s.scalars(select(Snapshot).order_by(Snapshot.ts)))
    d_up = [x for x in snaps if x.instance == "d0" and x.up]
    d_down = [x for x in snaps if x.instance == "d0" and not x.up]
    assert d_up and d_up[0].nixl_xfer_time_count == 23.0 and d_up[0].requests_length == 23.0
    assert d_down and all("HTTP 500" in (x.error or "") for x in d_down)
    assert len({x.ts for x in snaps if x.instance == "p0"}) == len([x for x in snaps if x.instance == "p0"])


# -- Debian's real Prometheus scraping a simulated fleet -------------------------------------


@pytest.fixture
def sim_fleet() -> Iterator[Any]:
    from simulator.testing import running_fleet

    with running_fleet(n_prefill=1, n_decode=1, seed=5, latency_scale=0.05) as f:
        yield f


@pytest.mark.promtool
@pytest.mark.slow
def test_collector_reads_a_real_prometheus(sim_fleet: Any, tmp_path: Path) -> None:
    import shutil

    from tests.deploy.test_real_prometheus import (
        pd_request,
        running_prometheus,
        write_prometheus_config,
    )

    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("promtool tier skipped: the prometheus server is not installed")
    (p_url,) = sim_fleet.prefill_urls
    (d_url,) = sim_fleet.decode_urls
    root = tmp_path / "prom"
    root.mkdir()
    config = write_prometheus_config(root, sim_fleet, {})
    store = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(store)
    with (
        running_prometheus(binary, root, config) as prom,
        httpx.Client(timeout=httpx.Timeout(10.0, connect=2.0)) as client,
    ):
        wait_until(
            "2 vLLM targets up",
            lambda: len(prom.query('up{job="vllm"} == 1')) == 2,
            timeout_s=30,
            every_s=0.5,
        )
        for _ in range(4):
            assert pd_request(client, sim_fleet.model_name, p_url, d_url, prompt_words=300) == 200
        direct = extract_signals(client.get(f"{d_url}/metrics").content)
        assert (direct.values.get("nixl_xfer_time_count") or 0) > 0
        # Prometheus has scraped after the traffic (1 s scrape interval)
        wait_until(
            "D's NIXL transfers in Prometheus",
            lambda: prom.query(
                'sum(vllm:nixl_xfer_time_seconds_count{instance="decode-0"}) '
                f">= {direct.values['nixl_xfer_time_count']}"
            ),
            timeout_s=30,
            every_s=0.5,
        )
        settings = parse_config(
            sim_fleet.config_yaml(
                store={"url": store},
                collector={
                    "host": "127.0.0.1",
                    "scrape_interval_s": 1,
                    "scrape_timeout_s": 0.8,
                    "prometheus_url": prom.url,
                    "prometheus_selector": 'job="vllm"',
                },
            )
        )

        factory = session_factory(make_engine(store))

        def newest() -> dict[str, Snapshot]:
            with factory() as s:
                return {x.instance: x for x in s.scalars(select(Snapshot).order_by(Snapshot.ts))}

        async def collect() -> None:
            service = CollectorService(settings, port=0)
            stop = asyncio.Event()
            task = asyncio.create_task(service.run(stop))
            try:
                await async_wait_until(
                    "a stored snapshot of each instance, D's with the transfers",
                    newest,
                    done=lambda by: (
                        set(by) == {"prefill-0", "decode-0"}
                        and by["decode-0"].nixl_xfer_time_count == direct.values["nixl_xfer_time_count"]
                        # Prometheus may have scraped P before its requests: wait for a scrape after them
                        and (by["prefill-0"].prompt_tokens or 0) > 0
                    ),
                    timeout_s=20,
                    every_s=0.25,
                )
            finally:
                stop.set()
                await asyncio.wait_for(task, timeout=15)

        asyncio.run(asyncio.wait_for(collect(), timeout=30))
    by_inst = newest()  # the newest of each
    assert set(by_inst) == {"prefill-0", "decode-0"}
    d, p = by_inst["decode-0"], by_inst["prefill-0"]
    assert d.up and p.up and d.error is None, (d.error, p.error)
    assert d.nixl_xfer_time_count == direct.values["nixl_xfer_time_count"] > 0
    assert d.nixl_bytes_sum == direct.values["nixl_bytes_sum"] > 0
    assert d.requests_length == direct.values.get("requests_length")
    assert d.requests_stop == direct.values.get("requests_stop")
    assert (d.requests_length or 0) + (d.requests_stop or 0) >= 4
    assert d.kv_cache_usage is not None and 0.0 <= d.kv_cache_usage <= 1.0
    assert d.histograms["vllm:nixl_xfer_time_seconds"] == direct.histograms["vllm:nixl_xfer_time_seconds"]
    assert p.prompt_tokens is not None and p.prompt_tokens > 0
    assert d.engines == direct.engines and d.process_start_ts == direct.process_start_ts
