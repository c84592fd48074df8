"""The collector service on its own event loop in a thread, for end-to-end tests.

A busy test loop cannot starve its scrapes. Entering the ``with`` block starts it and waits
until it serves; leaving the block stops it. Without ``collector.spool_dir`` in its settings it spools
in a folder of its own, removed when it stops (never the default under the temp dir, which outlives it).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from pathlib import Path

from pdscope.config import Settings
from tests.support.waiting import wait_until

START_TIMEOUT_S = 20.0


def with_own_spool(settings: Settings) -> tuple[Settings, Path | None]:
    """``settings`` with ``collector.spool_dir`` in a new temporary folder, and that folder, when they
    set none; else ``settings`` as they are, and None."""
    if settings.collector.spool_dir is not None:
        return settings, None
    folder = Path(tempfile.mkdtemp(prefix="pdscope-collector-spool-"))
    collector = settings.collector.model_copy(update={"spool_dir": str(folder)})
    return settings.model_copy(update={"collector": collector}), folder


class CollectorThread:
    def __init__(self, settings: Settings) -> None:
        from collector.service import CollectorService

        settings, self.spool_folder = with_own_spool(settings)
        self.service = CollectorService(settings, port=0)
        self.port = self.service.port
        self.loop = asyncio.new_event_loop()
        self.stop = asyncio.Event()
        self.thread = threading.Thread(target=self._main, name="collector", daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.service.run(self.stop))
        self.loop.close()

    def __enter__(self) -> CollectorThread:
        self.thread.start()
        wait_until(
            "the collector to start",
            lambda: self.service.started.is_set() or not self.thread.is_alive(),
            timeout_s=START_TIMEOUT_S,
        )
        if not self.service.started.is_set():
            raise AssertionError("the collector stopped before it started (see the log above)")
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(20)
        if self.spool_folder is not None:
            shutil.rmtree(self.spool_folder, ignore_errors=True)
