"""Waiting on a condition with a deadline: the one way a test waits for something to happen.

A probe is called until its result is done (truthy, or ``done(result)``); the result is
returned. When the deadline passes first, :class:`WaitTimeout` (an ``AssertionError``) names
what was awaited, for how long, and the last result or error the probe gave, so a failure
says what was seen rather than only that time ran out. The deadline is a guard against a
hang, never a bound the test asserts. Probes may raise one of ``ignore`` while the thing is
not there yet (a server still starting); other errors propagate at once.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_EVERY_S = 0.05


class WaitTimeout(AssertionError):
    """The condition did not hold before the deadline."""


def _failure(what: str, timeout_s: float, last: object, error: BaseException | None) -> WaitTimeout:
    seen = f"last error: {error!r}" if error is not None else f"last: {last!r}"
    return WaitTimeout(f"timed out after {timeout_s:g}s waiting for {what} ({seen})")


def wait_until(
    what: str,
    probe: Callable[[], T],
    *,
    done: Callable[[T], object] = bool,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    every_s: float = DEFAULT_EVERY_S,
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Call ``probe`` every ``every_s`` until ``done(result)``; return that result.

    Blocks the calling thread (use :func:`async_wait_until` inside an event loop). Raises
    :class:`WaitTimeout` after ``timeout_s``; the probe is always tried at least once.
    """
    deadline = time.monotonic() + timeout_s
    last: Any = None
    error: BaseException | None = None
    while True:
        try:
            result = probe()
        except ignore as exc:
            error = exc
        else:
            if done(result):
                return result
            last, error = result, None
        if time.monotonic() >= deadline:
            raise _failure(what, timeout_s, last, error)
        time.sleep(every_s)


async def async_wait_until(
    what: str,
    probe: Callable[[], T | Awaitable[T]],
    *,
    done: Callable[[T], object] = bool,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    every_s: float = DEFAULT_EVERY_S,
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """:func:`wait_until` for a running event loop: ``probe`` may be sync or async, and the
    pause between tries yields to the loop so the thing awaited can make progress."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    error: BaseException | None = None
    while True:
        try:
            got = probe()
            result: T = await got if inspect.isawaitable(got) else got
        except ignore as exc:
            error = exc
        else:
            if done(result):
                return result
            last, error = result, None
        if time.monotonic() >= deadline:
            raise _failure(what, timeout_s, last, error)
        await asyncio.sleep(every_s)
