"""The durable span spool (issue 26, item 1): accepted batches survive a store outage and a restart.

Every test here fails on the collector as it was: a batch the store could not take was counted
(``store_error``) and dropped after its 2xx, and nothing was kept across a restart.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from collector.otlp import SpanData
from collector.receiver import SpanBatcher, build_app
from collector.selfmetrics import CollectorMetrics
from collector.service import CollectorService, SpoolUnusable
from collector.sink import WriteResult
from collector.spool import ACKED_FILE, LOCK_FILE, Spool, SpoolConfig, SpoolFull, SpoolLocked, _segments
from pdscope.config import parse_config
from store.db import make_engine, session_factory
from store.migrate import upgrade
from store.models import RequestRecord
from tests.collector.traces import request_spans, take, to_proto
from tests.support.waiting import async_wait_until

PROTO = {"content-type": "application/x-protobuf"}


class Clock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _ids(spans: Sequence[SpanData]) -> list[str]:
    return [s.span_id for s in spans]


def _disk(tmp_path: Path, clock: Clock | None = None, **kw: object) -> Spool:
    spool = Spool(SpoolConfig(directory=tmp_path / "spool", **kw), clock or Clock())  # type: ignore[arg-type]
    spool.open()
    return spool


def test_batches_come_back_after_a_restart_in_order_and_equal(tmp_path: Path) -> None:
    batches = [request_spans(request_id=f"r{i}") for i in range(3)]
    spool = _disk(tmp_path)
    for b in batches:
        spool.append(b)
    spool.close()  # the process stops with all three pending
    again = _disk(tmp_path)
    assert again.batches == 3 and len(again) == sum(len(b) for b in batches)
    got = take(again)
    assert got == [s for b in batches for s in b]  # every field, events and sender included


def test_what_the_store_has_is_not_replayed(tmp_path: Path) -> None:
    a, b = request_spans(request_id="a"), request_spans(request_id="b")
    spool = _disk(tmp_path)
    spool.append(a)
    spool.append(b)
    spool.ack(spool.peek(len(a)))  # the store took the first batch
    spool.close()
    again = _disk(tmp_path)
    assert _ids(take(again)) == _ids(b)


def test_a_torn_tail_is_skipped_and_counted_never_a_crash(tmp_path: Path) -> None:
    spool = _disk(tmp_path)
    a, b = request_spans(request_id="a"), request_spans(request_id="b")
    spool.append(a)
    spool.append(b)
    spool.close()
    seg = tmp_path / "spool" / f"seg-{_segments(tmp_path / 'spool')[-1]:012d}.log"
    data = seg.read_bytes()
    seg.write_bytes(data[:-7])  # the host died in the middle of the second record
    again = _disk(tmp_path)
    assert again.corrupt == 1
    assert _ids(take(again)) == _ids(a)
    again.append(b)  # and the spool goes on
    again.close()
    third = _disk(tmp_path)
    assert third.corrupt == 0 and _ids(take(third)) == _ids(b)


def test_a_corrupt_record_ends_its_segment_and_is_counted(tmp_path: Path) -> None:
    spool = _disk(tmp_path)
    batches = [request_spans(request_id=f"r{i}") for i in range(3)]
    for b in batches:
        spool.append(b)
    spool.close()
    seg = tmp_path / "spool" / f"seg-{_segments(tmp_path / 'spool')[-1]:012d}.log"
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte inside the second record
    seg.write_bytes(bytes(data))
    again = _disk(tmp_path)
    assert again.corrupt == 1
    assert _ids(take(again)) == _ids(batches[0])


def test_garbage_in_the_ack_file_replays_everything_rather_than_crash(tmp_path: Path) -> None:
    spool = _disk(tmp_path)
    a = request_spans()
    spool.append(a)
    spool.close()
    (tmp_path / "spool" / ACKED_FILE).write_bytes(b"\x00not json")
    assert _ids(take(_disk(tmp_path))) == _ids(a)


def test_one_process_per_folder(tmp_path: Path) -> None:
    first = _disk(tmp_path)
    with pytest.raises(SpoolLocked):
        _disk(tmp_path)
    first.close()
    _disk(tmp_path).close()  # free again once the first one closed


def test_bounds_refuse_never_drop(tmp_path: Path) -> None:
    clock = Clock()
    spool = _disk(tmp_path, clock, max_bytes=6000, max_age_s=60.0)
    spool.append(request_spans())  # an empty spool takes any one batch
    with pytest.raises(SpoolFull) as full:
        for _ in range(100):
            spool.append(request_spans())
    assert full.value.reason == "spool_full"
    kept = len(spool)
    assert spool.pending_bytes <= 6000
    spool.ack(spool.peek(10**6))
    spool.append(request_spans())
    clock.t += 61  # the store has been gone a minute
    refused = spool.refusal(1)
    assert refused is not None and refused.reason == "spool_age"
    assert kept > 0 and len(spool) == 7


def test_past_the_memory_bound_batches_wait_on_disk_only_and_are_read_back(tmp_path: Path) -> None:
    spool = _disk(tmp_path, max_memory_spans=10)
    batches = [request_spans(request_id=f"r{i}") for i in range(4)]  # 7 spans each
    for b in batches:
        spool.append(b)
    assert spool.memory_spans == 7
    assert take(spool) == [s for b in batches for s in b]
    assert spool.memory_spans == 0


def test_wholly_acked_segments_are_deleted(tmp_path: Path) -> None:
    spool = _disk(tmp_path, segment_bytes=2**16)
    for i in range(60):
        spool.append(request_spans(request_id=f"r{i}"))
    d = tmp_path / "spool"
    assert len(_segments(d)) >= 3
    while spool.batches:
        spool.ack(spool.peek(50))
    assert len(_segments(d)) == 1  # only the active one
    spool.close()
    assert list(d.iterdir()) == []  # a clean stop with nothing pending leaves nothing, not even its lock
    d.rmdir()  # so the collector can remove its default folder (839 were left in /tmp/pdscope-spool)


def test_a_lock_taken_on_a_file_a_closing_spool_deleted_is_taken_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between a starting process's open of the lock file and its lock, the spool holding it closed
    empty and deleted the file: the starter must not run on a lock no later process can see."""
    d = tmp_path / "spool"
    first = _disk(tmp_path)
    real = fcntl.flock

    def holder_closes_first(fd: int, op: int) -> None:
        monkeypatch.setattr(fcntl, "flock", real)
        first.close()  # empty: it deletes the file the starter has just opened
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", holder_closes_first)
    second = _disk(tmp_path)
    assert second._lock_fd is not None
    assert os.fstat(second._lock_fd).st_ino == os.stat(d / LOCK_FILE).st_ino  # the file at the path
    with pytest.raises(SpoolLocked):
        _disk(tmp_path)  # so a third process sees it held
    second.close()


class OutageSink:
    """A store that is down (``retry``) until ``up`` is set."""

    def __init__(self) -> None:
        self.up = False
        self.calls = 0
        self.written: list[SpanData] = []

    def write(self, batch: Sequence[SpanData]) -> WriteResult:
        self.calls += 1
        if not self.up:
            return WriteResult(0, failed=len(batch), error="connection refused", retry=True)
        self.written.extend(batch)
        return WriteResult(len(batch))


async def test_a_store_outage_loses_nothing_and_the_backlog_is_replayed_in_order(tmp_path: Path) -> None:
    spool, metrics, sink = _disk(tmp_path), CollectorMetrics(), OutageSink()
    writer = SpanBatcher(spool, sink, metrics, batch_size=20, flush_s=0.01)
    stop = asyncio.Event()
    task = asyncio.create_task(writer.run(stop))
    sent: list[SpanData] = []
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=build_app(spool, metrics)), base_url="http://c"
    ) as client:
        for i in range(10):
            spans = request_spans(request_id=f"r{i}")
            resp = await client.post("/v1/traces", content=to_proto(spans), headers=PROTO)
            assert resp.status_code == 200
            sent.extend(spans)
            if i == 2:
                await async_wait_until("the writer to meet the outage", lambda: sink.calls >= 2)
        health = (await client.get("/healthz")).json()
    assert health["spool"]["spans"] == len(sent) and sink.written == []
    sink.up = True
    await async_wait_until("the backlog written", lambda: len(sink.written) == len(sent))
    stop.set()
    await asyncio.wait_for(task, timeout=10)
    assert _ids(sink.written) == _ids(sent)
    text = metrics.exposition().decode()
    assert not re.search(r"^pdscope_collector_spans_dropped_total\{", text, re.M)
    assert f"pdscope_collector_spool_replayed_spans_total {float(len(sent))}" in text
    assert "pdscope_collector_spool_bytes 0.0" in text


class RaisingSink:
    def __init__(self) -> None:
        self.calls = 0

    def write(self, batch: Sequence[SpanData]) -> WriteResult:
        self.calls += 1
        raise OverflowError("a bug in the sink")


async def test_a_batch_the_sink_always_raises_on_is_dropped_after_three_tries_and_counted() -> None:
    spool, metrics, sink = Spool.memory(100), CollectorMetrics(), RaisingSink()
    spool.append(request_spans())
    writer = SpanBatcher(spool, sink, metrics)
    for _ in range(3):
        await writer.flush()
    assert sink.calls == 3 and len(spool) == 0
    text = metrics.exposition().decode()
    assert 'pdscope_collector_spans_dropped_total{reason="writer_error"} 7.0' in text
    assert 'pdscope_collector_task_errors_total{reason="OverflowError",task="span_writer"} 3.0' in text


async def test_past_the_bound_exports_get_503_with_retry_after_and_nothing_is_dropped(tmp_path: Path) -> None:
    spool, metrics = _disk(tmp_path, max_bytes=2**20), CollectorMetrics()
    kept = refused = 0
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=build_app(spool, metrics)), base_url="http://c"
    ) as client:
        for i in range(2000):
            resp = await client.post(
                "/v1/traces", content=to_proto(request_spans(request_id=f"{i}")), headers=PROTO
            )
            if resp.status_code == 503:
                assert resp.headers["retry-after"] == "1"
                refused += 1
                if refused >= 3:
                    break
            else:
                assert resp.status_code == 200
                kept += 1
        assert (await client.get("/healthz")).json()["status"] == "degraded"
    assert refused == 3 and kept > 0
    assert len(spool) == 7 * kept  # every 200 is in the spool
    text = metrics.exposition().decode()
    assert 'pdscope_collector_spool_refused_spans_total{reason="spool_full"} 21.0' in text
    assert 'pdscope_collector_otlp_requests_total{result="spool_full"} 3.0' in text


def _settings(tmp_path: Path, spool_dir: Path) -> tuple[str, object]:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    upgrade(url)
    return url, parse_config(f"""
model: {{name: tiny, kv_bytes_per_token: 1024}}
pools:
  prefill: {{role: prefill, instances: [{{name: p0, url: "http://127.0.0.1:9"}}]}}
  decode: {{role: decode, instances: [{{name: d0, url: "http://127.0.0.1:9"}}]}}
store: {{url: "{url}"}}
collector: {{scrape_interval_s: 5, scrape_timeout_s: 0.3, spool_dir: "{spool_dir}"}}
""")


async def test_a_collector_restart_writes_what_its_spool_holds(tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    left = Spool(SpoolConfig(directory=spool_dir))  # what a killed collector left behind
    left.open()
    for i in range(5):
        left.append(request_spans(request_id=f"left-{i}"))
    left.close()
    url, settings = _settings(tmp_path, spool_dir)
    service = CollectorService(settings, port=0)  # type: ignore[arg-type]
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    factory = session_factory(make_engine(url))

    def records() -> int:
        with factory() as s:
            return int(s.scalar(select(func.count()).select_from(RequestRecord)) or 0)

    await async_wait_until("the 5 spooled requests recorded", records, done=lambda n: n == 5)
    stop.set()
    await asyncio.wait_for(task, timeout=20)
    assert _segments(spool_dir) == []


def test_a_spool_folder_in_use_is_a_clear_start_error(tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    holder = Spool(SpoolConfig(directory=spool_dir))
    holder.open()
    _, settings = _settings(tmp_path, spool_dir)
    service = CollectorService(settings, port=0)  # type: ignore[arg-type]
    with pytest.raises(SpoolUnusable, match=r"collector\.spool_dir"):
        service.open_spool()
    service.sock.close()
    holder.close()
