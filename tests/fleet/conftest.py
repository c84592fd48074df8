"""The fleet tier's fixtures: a fresh PostgreSQL database per test (the tier needs PostgreSQL and
skips loudly without it), a work folder for the fleet's configs and logs, and a private
PostgreSQL server for the test that restarts one."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.sockets import free_port

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.fleet


def _dsn(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


@pytest.fixture(scope="session")
def fleet_pg_admin() -> str:
    url = os.environ.get("PDSCOPE_TEST_PG_URL")
    if not url:
        pytest.skip(
            "FLEET tier skipped: it runs the whole fleet on PostgreSQL and PDSCOPE_TEST_PG_URL is not set "
            "(run `make test`, which starts one with scripts/pg-test.sh)"
        )
    return _dsn(url)


def _fresh_database(admin: str) -> Iterator[str]:
    import psycopg

    name = f"pdscope_fleet_{uuid.uuid4().hex[:10]}"
    try:
        with psycopg.connect(admin, autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as exc:
        pytest.fail(f"PDSCOPE_TEST_PG_URL is set but PostgreSQL is unreachable: {exc}")
    yield f"{admin.rsplit('/', 1)[0]}/{name}"
    try:
        with psycopg.connect(admin, autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    except psycopg.OperationalError:
        pass  # a private server already stopped: its folder goes with the test's


@pytest.fixture
def fleet_store(fleet_pg_admin: str) -> Iterator[str]:
    """A fresh, empty database on the shared test server, dropped after the test."""
    yield from _fresh_database(fleet_pg_admin)


class PrivatePg:
    """A PostgreSQL server of this test's own (scripts/pg-test.sh on its own port and folder), so a
    test may stop and start it without touching the server other tests share."""

    def __init__(self, folder: Path) -> None:
        self.env = {**os.environ, "PDSCOPE_PG_PORT": str(free_port()), "PDSCOPE_PG_DIR": str(folder)}

    def _run(self, action: str) -> str:
        out = subprocess.run(
            ["bash", str(REPO / "scripts" / "pg-test.sh"), action],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if out.returncode != 0:
            raise AssertionError(f"scripts/pg-test.sh {action} failed ({out.returncode}): {out.stderr}")
        return out.stdout.strip()

    def start(self) -> str:
        return self._run("start")

    def stop(self) -> None:
        self._run("stop")


@pytest.fixture
def private_pg(fleet_pg_admin: str) -> Iterator[PrivatePg]:
    """Needs the tier's PostgreSQL binaries (the shared server's presence says they are here). Its
    folder is one the server's user can enter (as root, the server runs as postgres: pytest's own
    temporary folders are private to root)."""
    folder = Path(tempfile.mkdtemp(prefix="pdscope-fleet-pg-"))
    folder.chmod(0o755)
    pg = PrivatePg(folder / "cluster")
    try:
        yield pg
    finally:
        pg.stop()
        shutil.rmtree(folder, ignore_errors=True)
