"""``write_or_check``: the ``[--check]`` command line of the deploy/ render scripts."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdscope.generated import write_or_check

DOC = "Renders thing.txt.\n\nMore words."


def test_writes_the_rendered_text(tmp_path: Path) -> None:
    out = tmp_path / "thing.txt"
    assert write_or_check([], DOC, out, lambda: "new\n", "deploy/x.py") == 0
    assert out.read_text() == "new\n"


def test_check_passes_on_a_fresh_file_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "thing.txt"
    out.write_text("same\n")
    before = out.stat().st_mtime_ns
    assert write_or_check(["--check"], DOC, out, lambda: "same\n", "deploy/x.py") == 0
    assert out.stat().st_mtime_ns == before


@pytest.mark.parametrize("on_disk", ["old\n", None])
def test_check_fails_on_a_stale_or_missing_file_and_names_the_script(
    on_disk: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "thing.txt"
    if on_disk is not None:
        out.write_text(on_disk)
    assert write_or_check(["--check"], DOC, out, lambda: "new\n", "deploy/x.py") == 1
    assert capsys.readouterr().err == f"{out} is stale: run python deploy/x.py\n"
    assert (out.read_text() if out.exists() else None) == on_disk


def test_help_uses_the_docstring_first_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        write_or_check(["--help"], DOC, tmp_path / "thing.txt", lambda: "", "deploy/x.py")
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    assert "Renders thing.txt." in help_text and "More words." not in help_text
    assert "exit 1 if thing.txt on disk is stale" in help_text
