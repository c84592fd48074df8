"""The repository stands alone: the suite refuses to read files beside it."""

from __future__ import annotations

import pytest

from tests.conftest import REPO


def test_a_read_beside_the_repository_fails_the_test() -> None:
    beside = REPO.parent.joinpath("shared", "ARCHITECTURE.md")  # what the guard exists to refuse
    with pytest.raises(PermissionError, match="outside the repository"):
        beside.read_text()


def test_reads_inside_the_repository_and_elsewhere_still_work() -> None:
    assert (REPO / "tests" / "captures.py").read_text()
    with open("/proc/self/status") as f:  # not beside the repository: allowed
        assert f.read(4)
