"""Full garbage collections at the tick loop's pace rather than the allocator's.

The leader keeps its windows between ticks (some 400,000 long-lived objects at 1,000 instances) and each
tick leaves about a quarter as many behind (the rows read, the tick record's document kept for the next
delta). CPython starts a full (generation 2) collection whenever the objects surviving into the oldest
generation since the last one reach a quarter of it, so nearly every tick paid one: 0.2 to 0.25 s of a
1.2 s tick at 1,000 instances, growing with the fleet.

:class:`FullCollections` turns the automatic full collections off while the loop runs and runs one after
every ``every``-th step instead (``controller.full_collection_every``), so their cost is spread over that
many ticks.

No young collection walks what the loop keeps, nor a tick's working set. A tick builds a working set that
lives until its end (the rows it read, the figures made of them, the record's document): 100-160 objects
an instance, 1.6 million at 10,000. And it keeps much of what it read, for the next ticks. CPython collects
the youngest generation whenever 700 more objects were made than freed, so every collection walked that
working set and the kept objects, all still alive, moved them to the middle generation and walked them
again there: at 10,000 instances 0.94 s of an 8.3 s tick, growing faster than the fleet (14 ms a tick at
1,000). While the loop runs:

- the youngest generation's threshold is :func:`young_threshold` of the fleet, above a tick's working set,
  so a tick runs no collection of its own;
- after each step every object the collector tracks is frozen (``gc.freeze``, which moves them in one
  step): what the tick kept is left out of every young collection from then on;
- the full collection every ``every``-th step unfreezes them first and walks them all.

So the loop's objects are walked once every ``every`` ticks. The threshold still bounds the garbage in
young reference cycles between two steps (a server thread's, when no tick runs). Garbage caught in
reference cycles lives at most ``every`` intervals; everything else is freed when its last reference goes,
as always, frozen or not. The thresholds are the process's: the first loop in sets them, and the last one
out restores them and unfreezes what is frozen (several controllers in one process leave them as they
found them whatever order they stop in).

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
YOUNG = 100_000  # the least youngest generation's threshold while the loop runs (at least CPython's own)
YOUNG_PER_INSTANCE = 300  # above a tick's working set per instance (100-160 measured at 1,000-10,000)


def young_threshold(instances: int) -> int:
    """The youngest generation's threshold while a loop over a fleet of ``instances`` runs: above the
    working set of its ticks, so that no young collection walks it."""
    return max(YOUNG, YOUNG_PER_INSTANCE * instances)


_process = threading.Lock()
_inside = 0  # the pacing loops running in this process
_saved: tuple[int, int, int] = (0, 0, 0)  # the thresholds the first of them found


class FullCollections:
    """The loop's full collections (``every`` 0: CPython's own pacing; the loop runs none itself); ``runs``
    and ``seconds`` (this thread's CPU) count those it ran. ``young``: the youngest generation's threshold
    while entered (:func:`young_threshold`)."""

    def __init__(self, every: int, clock: Callable[[], float] = time.thread_time, young: int = YOUNG) -> None:
        if every < 0:
            raise ValueError("full_collection_every: 0 or more")
        self.every = every
        self.clock = clock
        self.young = max(young, YOUNG)
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
                    young = max(_saved[0], self.young) if _saved[0] else 0  # 0: collection off, left off
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
                    gc.unfreeze()
                    gc.set_threshold(*_saved)

    def after_step(self) -> float:
        """Count a step; the CPU seconds of the full collection run after it (0.0: none was due, and what
        the step kept is frozen; or the pacing is not entered: CPython's own pacing goes on)."""
        if not self.every or not self._entered:
            return 0.0
        with self._lock:
            self._steps += 1
            due = not self._steps % self.every
        if due:
            return self.collect()
        self.settle()
        return 0.0

    def settle(self) -> None:
        """Freeze every object the collector tracks now (one step, whatever their number): left out of
        the young collections until the next full one (:meth:`collect`) walks them. Only while entered."""
        if self._entered:
            gc.freeze()

    def collect(self) -> float:
        """One full collection now, of the frozen objects too, counted; its CPU seconds."""
        started = self.clock()
        gc.unfreeze()
        gc.collect()
        spent = self.clock() - started
        with self._lock:
            self.runs += 1
            self.seconds += spent
        return spent
