"""Full garbage collections at the tick loop's pace rather than the allocator's.

The leader keeps its windows between ticks (some 400,000 long-lived objects at 1,000 instances) and each
tick leaves about a quarter as many behind (the rows read, the tick record's document kept for the next
delta). CPython starts a full (generation 2) collection whenever the objects surviving into the oldest
generation since the last one reach a quarter of it, so nearly every tick paid one: 0.2 to 0.25 s of a
1.2 s tick at 1,000 instances, growing with the fleet.

:class:`FullCollections` turns the automatic full collections off while the loop runs and runs one after
every ``every``-th step instead (``controller.full_collection_every``), so their cost is spread over that
many ticks. The youngest generation is collected once :data:`YOUNG` objects more were made than freed
(CPython's 700 otherwise): a tick makes and drops hundreds of thousands of rows, tuples and dicts, and at
700 those alive at that moment were walked some 260 times a tick, and 24 times in the middle generation
(31 ms of a 0.5 s tick at 1,000 instances, measured with ``gc.callbacks``; at 100,000, 13 ms). It bounds
the garbage in young reference cycles at that many objects (a few megabytes). Garbage caught in reference
cycles lives at most that many intervals longer; everything else is freed when its last reference goes,
as always. The thresholds are the process's: the first loop in turns
the automatic full collections off and the last one out restores them (several controllers in one
process leave them as they found them whatever order they stop in).

Only ``pdscope control`` enters it, around its server (``controller.cli``): there the kept windows are
most of the heap. A loop run inside another process (the tests' closed loops, in a pytest process whose
heap is far larger than the windows) keeps CPython's pacing: a full collection every 15 ticks of a
heap that size would cost far more than CPython's.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from types import TracebackType

OFF = 2**30  # a generation 2 threshold the loop never reaches
YOUNG = 100_000  # the youngest generation's threshold while the loop runs (at least CPython's own)

_process = threading.Lock()
_inside = 0  # the pacing loops running in this process
_saved: tuple[int, int, int] = (0, 0, 0)  # the thresholds the first of them found


class FullCollections:
    """The loop's full collections (``every`` 0: CPython's own pacing; the loop runs none itself);
    ``runs`` and ``seconds`` (this thread's CPU) count those it ran."""

    def __init__(self, every: int, clock: Callable[[], float] = time.thread_time) -> None:
        if every < 0:
            raise ValueError("full_collection_every: 0 or more")
        self.every = every
        self.clock = clock
        self.runs = 0
        self.seconds = 0.0
        self._steps = 0
        self._entered = False
        self._lock = threading.Lock()

    def __enter__(self) -> FullCollections:
        global _inside, _saved
        if self.every and not self._entered:
            with _process:
                if not _inside:
                    _saved = gc.get_threshold()
                    young = max(_saved[0], YOUNG) if _saved[0] else 0  # 0: collection off, left off
                    gc.set_threshold(young, _saved[1], OFF)
                _inside += 1
            self._entered = True
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        global _inside
        if self._entered:
            self._entered = False
            with _process:
                _inside -= 1
                if not _inside:
                    gc.set_threshold(*_saved)

    def after_step(self) -> float:
        """Count a step; the CPU seconds of the full collection run after it (0.0: none was due, or the
        pacing is not entered: CPython's own pacing goes on)."""
        if not self.every or not self._entered:
            return 0.0
        with self._lock:
            self._steps += 1
            if self._steps % self.every:
                return 0.0
        return self.collect()

    def collect(self) -> float:
        """One full collection now, counted; its CPU seconds."""
        started = self.clock()
        gc.collect()
        spent = self.clock() - started
        with self._lock:
            self.runs += 1
            self.seconds += spent
        return spent
