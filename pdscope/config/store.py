"""The ``store`` section: the database every service meets in, and what it keeps."""

from __future__ import annotations

from pydantic import field_validator

from pdscope.config.base import PositiveFloat, _Frozen

STORE_DRIVERS = ("sqlite", "sqlite+pysqlite", "postgresql", "postgres", "postgresql+psycopg")


class StoreSettings(_Frozen):
    url: str = "sqlite:///pdscope.db"
    """SQLAlchemy URL of the store shared by every service: sqlite:///FILE or
    postgresql[+psycopg]://USER@HOST/DB (psycopg 3); another scheme is an error"""
    retention_raw_s: PositiveFloat = 6 * 3600.0
    """seconds raw snapshots, spans and request records are kept (never deleted before their minute is rolled
    up); also the collector's too_old horizon for incoming spans"""
    retention_rollup_s: PositiveFloat = 30 * 86400.0
    """seconds the per-minute rollups (per instance and per P x D pair) are kept"""

    @field_validator("url")
    @classmethod
    def _supported_url(cls, value: str) -> str:
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        try:
            driver = make_url(value).drivername
        except (ArgumentError, ValueError) as exc:
            raise ValueError("not a database URL; use sqlite:///FILE or postgresql://USER@HOST/DB") from exc
        if driver not in STORE_DRIVERS:
            raise ValueError(
                f"unsupported database {driver!r}; use sqlite:///FILE or postgresql://USER@HOST/DB "
                "(driver psycopg)"
            )
        return value
