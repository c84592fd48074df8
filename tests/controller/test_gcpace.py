"""The serving loop's full garbage collections (``controller.gcpace``): CPython's automatic ones off while
the loop runs, one every ``controller.full_collection_every`` steps instead, the thresholds restored."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from controller.gcpace import OFF, YOUNG, YOUNG_PER_INSTANCE, FullCollections, young_threshold
from tests.controller.conftest import World
from tests.support.waiting import async_wait_until


@pytest.fixture
def thresholds() -> Iterator[tuple[int, int, int]]:
    """The process's thresholds, set back after the test whatever it did."""
    saved = gc.get_threshold()
    yield saved
    gc.set_threshold(*saved)


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_inside_the_full_collections_are_off_and_the_young_ones_paced(
    thresholds: tuple[int, int, int],
) -> None:
    gc.set_threshold(500, 7, 9)
    with FullCollections(4):
        assert gc.get_threshold() == (YOUNG, 7, OFF)
    assert gc.get_threshold() == (500, 7, 9)
    gc.set_threshold(YOUNG * 2, 7, 9)  # a process that asked for fewer young collections keeps them
    with FullCollections(4):
        assert gc.get_threshold() == (YOUNG * 2, 7, OFF)
    gc.set_threshold(0, 7, 9)  # one that turned automatic collection off keeps it off
    with FullCollections(4):
        assert gc.get_threshold() == (0, 7, OFF)
    assert gc.get_threshold() == (0, 7, 9)


@pytest.mark.parametrize("order", ["first out first", "last in first out"])
def test_two_loops_leave_the_thresholds_as_they_found_them(
    thresholds: tuple[int, int, int], order: str
) -> None:
    gc.set_threshold(600, 8, 11)
    one, two = FullCollections(3), FullCollections(5)
    one.__enter__()
    two.__enter__()
    assert gc.get_threshold() == (YOUNG, 8, OFF)
    first, last = (one, two) if order == "first out first" else (two, one)
    first.__exit__(None, None, None)
    assert gc.get_threshold() == (YOUNG, 8, OFF)  # the other still runs
    last.__exit__(None, None, None)
    assert gc.get_threshold() == (600, 8, 11)


def test_none_paced_leaves_cpython_alone(thresholds: tuple[int, int, int]) -> None:
    pacer = FullCollections(0)
    with pacer:
        assert gc.get_threshold() == thresholds
        assert [pacer.after_step() for _ in range(5)] == [0.0] * 5
    assert (pacer.runs, pacer.seconds) == (0, 0.0)


@pytest.mark.parametrize("age", ["young", "old"])
def test_a_cycle_is_freed_by_the_every_th_step(thresholds: tuple[int, int, int], age: str) -> None:
    ticks = iter([10.0, 10.5, 20.0, 20.25])
    pacer = FullCollections(3, clock=lambda: next(ticks))
    was_enabled = gc.isenabled()
    gc.disable()  # only the pacer's collections run: the cycle lives until one does
    try:
        with pacer:
            cycle = _Cycle()
            if age == "old":
                gc.collect()  # it survives a full collection: in the oldest generation
            ref = weakref.ref(cycle)
            del cycle
            assert [pacer.after_step(), pacer.after_step()] == [0.0, 0.0]
            assert ref() is not None
            gc.collect(1)  # a young collection passes over what a step left frozen
            assert ref() is not None
            assert pacer.after_step() == 0.5
            assert ref() is None
            assert [pacer.after_step(), pacer.after_step(), pacer.after_step()] == [0.0, 0.0, 0.25]
    finally:
        if was_enabled:
            gc.enable()
    assert (pacer.runs, pacer.seconds) == (2, 0.75)


def test_what_a_step_kept_is_frozen_until_the_next_full_collection(thresholds: tuple[int, int, int]) -> None:
    pacer = FullCollections(2)
    assert gc.get_freeze_count() == 0
    with pacer:
        pacer.after_step()
        assert gc.get_freeze_count() > 0
        pacer.after_step()  # the full one
        assert gc.get_freeze_count() == 0
        pacer.after_step()
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0  # the last loop out unfreezes
    FullCollections(2).settle()  # not entered: nothing frozen
    assert gc.get_freeze_count() == 0


def test_the_young_threshold_is_above_a_ticks_working_set(thresholds: tuple[int, int, int]) -> None:
    assert young_threshold(10) == YOUNG  # never under the least
    assert young_threshold(10_000) == YOUNG_PER_INSTANCE * 10_000 > YOUNG
    gc.set_threshold(700, 10, 10)
    with FullCollections(15, young=young_threshold(10_000)):
        assert gc.get_threshold() == (YOUNG_PER_INSTANCE * 10_000, 10, OFF)
    assert gc.get_threshold() == (700, 10, 10)
    gc.set_threshold(0, 10, 10)  # automatic collection off: kept off
    with FullCollections(15, young=young_threshold(10_000)):
        assert gc.get_threshold() == (0, 10, OFF)


def test_a_negative_pace_is_refused() -> None:
    with pytest.raises(ValueError, match="full_collection_every"):
        FullCollections(-1)


async def test_the_serving_loop_paces_them_while_entered(
    world: World, thresholds: tuple[int, int, int]
) -> None:
    rec = world.reconciler
    fast = world.settings.controller.model_copy(update={"interval_s": 0.01, "full_collection_every": 2})
    rec.settings = world.settings.model_copy(update={"controller": fast})
    rec.collections = FullCollections(2)
    stop = asyncio.Event()
    rec.collections.__enter__()  # as pdscope control does, around its server
    loop = asyncio.create_task(rec.run_forever(stop))
    seen = await async_wait_until(
        "two paced full collections",
        lambda: (rec.collections.runs, gc.get_threshold()),
        done=lambda got: got[0] >= 2,
    )
    assert seen[1][2] == OFF
    stop.set()
    await loop
    rec.collections.__exit__(None, None, None)
    assert gc.get_threshold() == thresholds
    view = rec.view()
    assert view.ticks >= 4 and view.full_collections[0] >= 2 and view.full_collections[1] > 0.0


def test_a_loop_not_entered_leaves_cpython_its_pacing(thresholds: tuple[int, int, int]) -> None:
    """A loop inside another process (the tests' closed loops) runs no full collection of its own."""
    pacer = FullCollections(1)
    assert [pacer.after_step() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert pacer.runs == 0 and gc.get_threshold() == thresholds


def test_the_loop_sizes_its_young_threshold_by_its_fleet(world: World) -> None:
    instances = sum(1 for _ in world.settings.instances())
    assert world.reconciler.collections.young == young_threshold(instances)
    assert world.reconciler.collections.every == world.settings.controller.full_collection_every
