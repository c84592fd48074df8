"""The SQLite controller lock is the database file's, whatever path names it: a hard link, a symlink
or ``x/../s.db`` to the file one controller leads on starts no second leader."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from controller.cli import serve
from controller.leader import AlreadyRunning, FileLock, lock_path_for, open_leadership
from tests.controller.seed import settings_yaml


def _hard_link(db: Path) -> Path:
    os.link(db, db.with_name("alias.db"))
    return db.with_name("alias.db")


def _symlink(db: Path) -> Path:
    (db.parent / "elsewhere").mkdir()
    link = db.parent / "elsewhere" / "link.db"
    link.symlink_to(db)
    return link


def _dotdot(db: Path) -> Path:
    (db.parent / "x").mkdir()
    return db.parent / "x" / ".." / db.name


ALIASES: dict[str, Callable[[Path], Path]] = {"hard link": _hard_link, "symlink": _symlink, "x/..": _dotdot}


@pytest.mark.parametrize("alias", list(ALIASES), ids=list(ALIASES))
def test_two_controllers_one_on_an_alias_of_the_file_only_one_leads(
    tmp_path: Path, alias: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import uvicorn

    db = tmp_path / "s.db"
    first = FileLock(db, "ctl-a:8300")  # creates the file: the alias needs one to point at
    first.release()
    other = ALIASES[alias](db)
    seen: dict[str, Any] = {}

    def fake_run(app: Any, **kwargs: Any) -> None:  # while the first one serves, a second one starts
        seen["second"] = serve(settings_yaml(f"sqlite:///{other}"), None)

    monkeypatch.setattr(uvicorn, "run", fake_run)
    assert serve(settings_yaml(f"sqlite:///{db}"), None) == 0
    assert seen["second"] == 1  # refused: only the first leads
    err = capsys.readouterr().err
    assert "another controller already runs on" in err and f"pid {os.getpid()}" in err


def test_the_lock_is_keyed_by_device_and_inode_and_creates_the_file(tmp_path: Path) -> None:
    db = tmp_path / "new.db"
    path = lock_path_for(db)
    st = os.stat(db)  # created (empty) by the lock
    assert path == tmp_path / f".pdscope-controller-{st.st_dev}-{st.st_ino}.lock"
    alias = _hard_link(db)
    assert lock_path_for(alias) == path
    held = open_leadership(f"sqlite:///{db}", "ctl-a", 10.0)
    with pytest.raises(AlreadyRunning) as err:
        open_leadership(f"sqlite:///{alias}", "ctl-b", 10.0)
    assert "ctl-a" in err.value.detail and str(path) in err.value.detail
    held.release()
    open_leadership(f"sqlite:///{alias}", "ctl-b", 10.0).release()  # released: the alias may lead now
