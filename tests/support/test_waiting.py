"""The wait helpers: the first done result comes back; a timeout says what was awaited and seen."""

from __future__ import annotations

import itertools

import pytest

from tests.support.waiting import WaitTimeout, async_wait_until, wait_until


def test_returns_the_first_result_that_is_done() -> None:
    counter = itertools.count()
    assert wait_until("three tries", lambda: next(counter), done=lambda n: n >= 3, every_s=0) == 3


def test_a_timeout_names_what_was_awaited_and_the_last_result() -> None:
    with pytest.raises(WaitTimeout, match=r"timed out after 0\.01s waiting for the moon \(last: 'cheese'\)"):
        wait_until("the moon", lambda: "cheese", done=lambda s: s == "moon", timeout_s=0.01, every_s=0)


def test_ignored_errors_mean_not_yet_and_the_last_one_is_reported() -> None:
    tries = itertools.count()

    def probe() -> str:
        if next(tries) < 2:
            raise ConnectionError("not listening yet")
        return "up"

    assert wait_until("a server", probe, ignore=(ConnectionError,), every_s=0) == "up"

    def refused() -> str:
        raise ConnectionError("refused")

    with pytest.raises(WaitTimeout, match=r"last error: ConnectionError\('refused'\)"):
        wait_until("a server", refused, ignore=(ConnectionError,), timeout_s=0.01, every_s=0)


def test_other_errors_propagate_at_once() -> None:
    def broken() -> int:
        raise KeyError("bug")

    with pytest.raises(KeyError):
        wait_until("anything", broken, ignore=(ConnectionError,))


async def test_the_async_helper_awaits_an_async_probe() -> None:
    counter = itertools.count()

    async def probe() -> int:
        return next(counter)

    assert await async_wait_until("two tries", probe, done=lambda n: n == 2, every_s=0) == 2
    with pytest.raises(WaitTimeout, match="waiting for never"):
        await async_wait_until("never", lambda: 0, timeout_s=0.01, every_s=0)
