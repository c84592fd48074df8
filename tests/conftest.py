"""Shared fixtures and the test-tier bookkeeping.

Tiers are pytest markers (``pg``, ``real_vllm``, ``promtool``, ``browser``). At the end
of a run each tier's passed/failed/skipped counts are printed and written to
``.test-tiers.json``. With ``CI=true``, a tier named in ``$PDSCOPE_REQUIRED_TIERS``
that skipped anything, or passed nothing, fails the run: CI must never skip them.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

TIERS = ("pg", "fleet", "real_vllm", "promtool", "browser")
REPO = Path(__file__).resolve().parent.parent
_INSIDE = str(REPO) + os.sep
# A clone straight into the temp folder (or /) has the whole of it beside it; there only the
# folder the repository must not rely on is guarded, so pytest's own temp files stay usable.
_OUTSIDE = (
    str(REPO.parent.joinpath("shared"))
    if REPO.parent in (Path(tempfile.gettempdir()), Path("/"))
    else str(REPO.parent)
) + os.sep


def _refuse_reads_beside_the_repository(event: str, args: tuple[object, ...]) -> None:
    """The repository stands alone: no test opens a file beside it (a sibling folder of the checkout).

    An audit hook on ``open``: a path under the repository's parent folder but outside the
    repository itself raises, so such a test fails here and not only on a clone with
    nothing beside it (``.ci/run`` runs from one of those too).
    """
    if event != "open" or not args or not isinstance(args[0], str | bytes):
        return
    path = os.path.abspath(os.fsdecode(args[0]))
    if path.startswith(_OUTSIDE) and not (path + os.sep).startswith(_INSIDE):
        raise PermissionError(f"test read {path}: outside the repository (it must stand alone)")


sys.addaudithook(_refuse_reads_beside_the_repository)

_counts: dict[str, dict[str, int]] = defaultdict(lambda: {"passed": 0, "failed": 0, "skipped": 0})
_skip_reasons: dict[str, set[str]] = defaultdict(set)


def _tier_of(item: pytest.Item) -> str:
    for tier in TIERS:
        if item.get_closest_marker(tier) is not None:
            return tier
    return "unit"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.user_properties.append(("tier", _tier_of(item)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tier = dict(report.user_properties).get("tier", "unit")
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if report.skipped:
            _counts[tier]["skipped"] += 1
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            _skip_reasons[tier].add(reason)
        elif report.failed:
            _counts[tier]["failed"] += 1
        elif report.when == "call":
            _counts[tier]["passed"] += 1


def _required_tiers() -> list[str]:
    raw = os.environ.get("PDSCOPE_REQUIRED_TIERS", "")
    return [t.strip() for t in raw.split(",") if t.strip()]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    (REPO / ".test-tiers.json").write_text(json.dumps(_counts, indent=2, sort_keys=True))
    if os.environ.get("CI", "").lower() != "true":
        return
    for tier in _required_tiers():
        c = _counts.get(tier, {"passed": 0, "failed": 0, "skipped": 0})
        if c["skipped"] or not c["passed"]:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    tr = terminalreporter
    tr.section("pdscope test tiers")
    for tier in ("unit", *TIERS):
        c = _counts.get(tier)
        if c is None:
            tr.write_line(f"{tier:>10}: no tests collected")
            continue
        tr.write_line(f"{tier:>10}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped")
        for reason in sorted(_skip_reasons.get(tier, ())):
            tr.write_line(f"{'':>12}SKIPPED TIER {tier.upper()}: {reason}", yellow=True, bold=True)
    if os.environ.get("CI", "").lower() == "true":
        for tier in _required_tiers():
            c = _counts.get(tier, {"passed": 0, "failed": 0, "skipped": 0})
            if c["skipped"] or not c["passed"]:
                tr.write_line(
                    f"REQUIRED TIER {tier!r} DID NOT RUN IN FULL IN CI "
                    f"({c['passed']} passed, {c['skipped']} skipped): failing the run",
                    red=True,
                    bold=True,
                )


# -- the collector's spool --------------------------------------------------------------
#
# A collector without ``collector.spool_dir`` spools in <temp dir>/pdscope-spool/<hash of its store URL
# and id> (collector/service.py ``default_spool_dir``), a folder meant to outlive its process while it
# holds spans; a clean stop with nothing pending removes it. tests/support's collectors and fleets, the
# goodput bench and the what-if runs spool inside their own folders. The guard checks that no test
# leaves a folder there (a collector killed, or stopped with spans pending, on the default spool)
# without reading the machine's shared folder, where other sessions and benchmarks write at any time:
# this session's temp dir (TMPDIR, inherited by its children) is a private folder of its own, so a
# collector that falls back to the default spools there, where nothing else writes. The folders that
# appear there are noted after each test; the session fails naming them and the tests they appeared
# in, and the private folder goes at the end: a test run leaves nothing in the shared one.

SPOOL_FOLDER = "pdscope-spool"


class _SpoolGuard:
    """The default spool folders that appear under ``temp_dir``, by the test during which each did."""

    def __init__(self, temp_dir: Path) -> None:
        self.spool = temp_dir / SPOOL_FOLDER
        self.seen: set[str] = set()
        self.left: dict[str, list[str]] = {}
        self.current = ""  # the test running, set as each starts

    def note(self) -> None:
        now = set(os.listdir(self.spool)) if self.spool.is_dir() else set()
        if new := sorted(now - self.seen):
            self.left.setdefault(self.current, []).extend(new)
        self.seen = now


def _spool_lines(left: dict[str, list[str]]) -> list[str]:
    return [f"  {test}: {', '.join(names)}" for test, names in left.items()]


_spool_guard: _SpoolGuard | None = None
_spool_active = False
_test_started = "the session's setup"  # the last test to start (the guard starts within the first)


@pytest.fixture(scope="session", autouse=True)
def _private_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """This session's temp dir, for it and its children: a private folder, removed at the end; fails
    the session when a collector left a default spool folder in it (see above)."""
    global _spool_guard, _spool_active
    tmp_path_factory.getbasetemp()  # pytest's own folders (tmp_path) stay where they always are
    private = Path(tempfile.mkdtemp(prefix="pdscope-tests-"))
    private.chmod(0o755)  # as /tmp is to them: the test PostgreSQL servers run as postgres, in folders here
    saved_env, saved_tempdir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = str(private)
    guard = _spool_guard = _SpoolGuard(private)
    guard.current = _test_started
    _spool_active = True
    try:
        yield private
    finally:
        _spool_active = False
        tempfile.tempdir = saved_tempdir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
        guard.note()  # what the last test's (and the session's) fixtures left as they stopped
        shutil.rmtree(private, ignore_errors=True)
    if new := guard.left:
        pytest.fail(
            f"collectors spooled in the default <temp dir>/{SPOOL_FOLDER}, a folder that outlives the run "
            "on any other session: set collector.spool_dir inside the test's own folder. Folders, by the "
            "test during which each appeared:\n" + "\n".join(_spool_lines(new)),
            pytrace=False,
        )


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    global _test_started
    _test_started = nodeid
    if _spool_guard is not None and _spool_active:
        _spool_guard.note()
        _spool_guard.current = nodeid


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    if _spool_guard is not None and _spool_active:
        _spool_guard.note()


# -- stores ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_admin_url() -> str:
    url = os.environ.get("PDSCOPE_TEST_PG_URL")
    if not url:
        pytest.skip(
            "PostgreSQL tier skipped: PDSCOPE_TEST_PG_URL is not set "
            "(run `make test`, which starts one with scripts/pg-test.sh)"
        )
    return url


@pytest.fixture(scope="session")
def pg_database(pg_admin_url: str) -> Iterator[str]:
    """A fresh PostgreSQL database for this test session, dropped at the end."""
    import psycopg

    name = f"pdscope_test_{uuid.uuid4().hex[:10]}"
    dsn = pg_admin_url.replace("postgresql+psycopg://", "postgresql://")
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as exc:
        pytest.fail(f"PDSCOPE_TEST_PG_URL is set but PostgreSQL is unreachable: {exc}")
    base = dsn.rsplit("/", 1)[0]
    yield f"{base}/{name}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _reset_pg(url: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.pg)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty store: a SQLite file, or a clean PostgreSQL database (the ``pg`` tier)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    url: str = request.getfixturevalue("pg_database")
    _reset_pg(url)
    return url


@pytest.fixture
def store_factory(store_url: str) -> Iterator[Any]:
    """A session factory of an empty store migrated to head (``store_url``'s), its engine disposed after."""
    from store.db import make_engine, session_factory
    from store.migrate import upgrade

    upgrade(store_url)
    engine = make_engine(store_url)
    yield session_factory(engine)
    engine.dispose()
