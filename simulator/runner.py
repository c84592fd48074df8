"""Drives one ``Engine`` in real time on the running asyncio loop.

The runner owns the only loop that calls the engine's step functions: it steps while
there is work (sleeping each step's modelled duration; ``latency_scale: 0`` steps
without sleeping), and otherwise sleeps until the engine's next timer or a wake-up
(a new request, freed blocks, a fault change). It must never block the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from simulator.engine import Engine
from simulator.model import SimRequest

logger = logging.getLogger(__name__)


class EngineRunner:
    def __init__(self, engine: Engine, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.clock = clock
        self._wake = asyncio.Event()
        self._stopped = False
        self._task: asyncio.Task[None] | None = None
        engine.on_free = self.wake

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"engine-{self.engine.name}")

    async def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def wake(self) -> None:
        self._wake.set()

    def submit(self, req: SimRequest) -> None:
        self.engine.submit(req, self.clock())
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        self.engine.abort(req, self.clock())
        self._wake.set()

    async def _run(self) -> None:
        engine = self.engine
        clock = self.clock
        while not self._stopped:
            try:
                now = clock()
                engine.advance(now)
                duration = engine.begin_step(now) if engine.has_work() else None
                if duration is not None:
                    await asyncio.sleep(duration if duration > 0 else 0)
                    engine.end_step(clock())
                    engine.flush_events()
                    continue
                engine.flush_events()
                nxt = engine.next_timer()
                timeout = None if nxt is None else max(0.0, nxt - clock())
                if timeout == 0.0:
                    await asyncio.sleep(0)
                    continue
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.CancelledError:
                raise
            except Exception:  # a model bug must not kill the instance silently
                logger.exception("engine %s step failed", engine.name)
                await asyncio.sleep(0.01)
