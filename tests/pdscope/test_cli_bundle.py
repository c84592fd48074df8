"""``pdscope bundle``: an archive of a seeded range, and every way it refuses (nothing partial left)."""

from __future__ import annotations

import errno
import json
import os
import tarfile
import time
from pathlib import Path
from typing import IO, Any

import pytest

import controller.bundle as bundle_mod
from pdscope import cli
from pdscope.config import load_config
from store.db import make_engine, session_factory
from store.migrate import upgrade
from tests.controller.seed import Seeder, all_pairs

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "examples" / "pdscope.yaml")


@pytest.fixture
def store(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'bundle.db'}"
    upgrade(url)
    engine = make_engine(url)
    seeder = Seeder(session_factory(engine), load_config(CONFIG))
    t = time.time() - 600
    for k in range(4):
        seeder.scrape(t + k)
        seeder.requests(t + k, all_pairs(), prefill_s={"prefill-1": 2.5} if k >= 2 else None)
    engine.dispose()
    return url


def bundle(url: str, *args: str) -> int:
    return cli.main(["--config", CONFIG, "bundle", "--store", url, *args])


def test_writes_one_archive_of_the_range(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert bundle(store, "--since", "1h", "--out", str(out)) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path.parent == out and path.name.startswith("pdscope-range-") and path.name.endswith("Z.tar.gz")
    assert [p.name for p in out.iterdir()] == [path.name]
    with tarfile.open(path, "r:gz") as tar:
        names = {m.name.split("/", 1)[1] for m in tar.getmembers()}
        folder = path.name.removesuffix(".tar.gz")
        man = json.load(tar.extractfile(f"{folder}/manifest.json"))  # type: ignore[arg-type]
        page = tar.extractfile(f"{folder}/report.html").read().decode()  # type: ignore[union-attr]
    assert {"manifest.json", "report.html", "records.jsonl", "snapshots.jsonl", "attribution.json"} <= names
    assert man["reason"] == "range" and man["trigger"] is None
    assert man["tables"]["records"]["rows_included"] == 4 * 8
    assert "Written on demand (pdscope bundle)." in page and "prefill on prefill-1" in page


def test_the_default_range_is_the_configured_window(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bundle(store, "--out", str(tmp_path / "out"), "--max-records", "10") == 0  # 900 s back
    path = Path(capsys.readouterr().out.strip())
    with tarfile.open(path, "r:gz") as tar:
        man = json.load(tar.extractfile(f"{path.name.removesuffix('.tar.gz')}/manifest.json"))  # type: ignore[arg-type]
    assert man["window"]["until"] - man["window"]["from"] == pytest.approx(900)
    assert man["tables"]["records"]["rows_in_window"] == 32 and man["tables"]["records"]["rows_read"] <= 10
    assert man["limits"]["max_records"] == 10 and man["truncated"] is True


def test_a_range_with_no_data_says_so_fails_and_writes_nothing(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert bundle(store, "--from", "1000", "--until", "2000", "--out", str(out)) == 1
    err = capsys.readouterr().err
    assert "pdscope bundle: nothing stored from 1970-01-01 00:16:40 UTC to 1970-01-01 00:33:20 UTC" in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("--since", "soon"), "--since"),
        (("--since", "9d"), "--since"),
        (("--since", "5m", "--from", "1"), "--since"),
        (("--from", "2000", "--until", "1000"), "--from"),
        (("--max-records", "0"), "--max-records"),
        (("--max-bytes", "10"), "--max-bytes"),
    ],
)
def test_a_bad_range_or_limit_names_the_flag(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], flag: str
) -> None:
    assert bundle(store, "--out", str(tmp_path / "out"), *args) == 2
    assert capsys.readouterr().err.startswith(f"pdscope bundle: {flag}: ")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes a read-only folder")
def test_a_read_only_folder_is_named_and_nothing_is_left(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    try:
        assert bundle(store, "--since", "1h", "--out", str(out)) == 1
        assert list(out.iterdir()) == []
    finally:
        out.chmod(0o755)
    assert f"pdscope bundle: cannot write a bundle in {out}: it is read-only" in capsys.readouterr().err


def test_a_read_only_file_system_is_named_and_nothing_is_left(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same as a chmod'ed folder where the tests run as root (which writes one anyway)."""

    def refused(*args: Any, **kw: Any) -> Any:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(bundle_mod.tempfile, "mkstemp", refused)
    out = tmp_path / "ro"
    out.mkdir()
    assert bundle(store, "--since", "1h", "--out", str(out)) == 1
    assert f"pdscope bundle: cannot write a bundle in {out}: it is read-only" in capsys.readouterr().err
    assert list(out.iterdir()) == []


def test_a_full_disk_is_named_and_nothing_is_left(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fileobj: IO[bytes], members: Any, mtime: float) -> None:
        fileobj.write(b"\x1f\x8b" + b"\0" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(bundle_mod, "_write_tar", full)
    out = tmp_path / "full"
    assert bundle(store, "--since", "1h", "--out", str(out)) == 1
    assert (
        f"pdscope bundle: cannot write a bundle in {out}: no space left on the device"
        in capsys.readouterr().err
    )
    assert list(out.iterdir()) == [], "the temporary file is removed"


def test_an_unreadable_store_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"  # no tables: never migrated
    assert bundle(url, "--out", str(tmp_path / "out")) == 1
    assert "pdscope bundle: the store cannot be read" in capsys.readouterr().err


def test_help_lists_bundle() -> None:
    assert "    bundle " in cli.build_parser().format_help()
