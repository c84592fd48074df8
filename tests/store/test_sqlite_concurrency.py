"""One writer and two readers on the SQLite store at once: no "database is locked"."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from sqlalchemy import func, select, text

from store import Snapshot, make_engine, session_factory, transaction
from store.migrate import upgrade

ROWS = 400


def test_wal_mode_and_busy_timeout(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 's.db'}")
    with engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA busy_timeout")).scalar() >= 5000
    engine.dispose()


def test_one_writer_two_readers(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    upgrade(url)
    errors: list[BaseException] = []
    reads = [0, 0]
    seen_max = [0, 0]
    done = threading.Event()

    def writer() -> None:
        factory = session_factory(make_engine(url))
        try:
            for i in range(ROWS):
                with transaction(factory) as s:  # one commit per row: the worst case for locking
                    s.add(
                        Snapshot(
                            instance=f"d{i % 4}",
                            pool="decode",
                            role="decode",
                            ts=time.time(),
                            up=True,
                            kv_cache_usage=i / ROWS,
                        )
                    )
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    def reader(k: int) -> None:
        factory = session_factory(make_engine(url))
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                finished = done.is_set()
                with transaction(factory) as s:
                    n = s.scalar(select(func.count()).select_from(Snapshot)) or 0
                    s.scalar(select(func.avg(Snapshot.kv_cache_usage)).where(Snapshot.instance == "d1"))
                assert n >= seen_max[k], "a reader saw the row count go backwards"
                seen_max[k] = n
                reads[k] += 1
                if finished:
                    return
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, f"errors under concurrency: {errors[:3]}"
    assert reads[0] > 1 and reads[1] > 1, "readers must have overlapped the writer"
    assert seen_max == [ROWS, ROWS]
