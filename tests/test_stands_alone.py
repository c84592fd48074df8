"""The repository stands alone: the suite refuses to read files beside it, and nothing in it
points a reader at documents beside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

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


# Documents that live beside the repository, never in it: code, comments and docs must not
# send a reader to them (what they say belongs in docs/ or in the code itself).
_OUTSIDE_DOCS = re.compile(
    r"ARCHITECTURE\.md|STYLE\.md|vllm-pd-facts|proxy-baseline|anchors\.md|/work/|\bshared/|\bseeds/"
)
_TEXT = re.compile(r"(\.(py|md|sh|toml|ya?ml|cfg|ini|txt|mako)|Makefile|Dockerfile[^/]*|/run)$")


def _pointers_outside(files: list[Path], root: Path) -> list[str]:
    hits = []
    for path in files:
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if _OUTSIDE_DOCS.search(line):
                hits.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    return hits


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True, timeout=60
    ).stdout
    this = Path(__file__).resolve()
    return [
        REPO / name
        for name in out.split("\0")
        if name and _TEXT.search(name) and (REPO / name).is_file() and (REPO / name).resolve() != this
    ]


def test_nothing_points_at_documents_outside_the_repository() -> None:
    files = _tracked_text_files()
    assert any(p.name == "README.md" for p in files) and any(p.suffix == ".py" for p in files)
    assert _pointers_outside(files, REPO) == []


def test_the_pointer_check_sees_one(tmp_path: Path) -> None:
    probe = tmp_path / "admission.py"
    probe.write_text(
        '"""Limits.\n\nThe proxy enforces these (see ARCHITECTURE.md).\n"""\n# see vllm-pd-facts 4.5\n'
    )
    assert _pointers_outside([probe], tmp_path) == [
        "admission.py:3: The proxy enforces these (see ARCHITECTURE.md).",
        "admission.py:5: # see vllm-pd-facts 4.5",
    ]
