"""pdscope's store: typed models, one engine/session factory, shared queries, migrations.

SQLite (WAL) is the embedded default; PostgreSQL is the production store. The proxy,
collector and controller never import each other; they meet here.
"""

from store.db import StoreError, make_engine, session_factory, transaction
from store.models import (
    Alert,
    AuditEvent,
    Base,
    Decision,
    InstanceRow,
    RequestRecord,
    Snapshot,
    SpanRow,
    WeightOverride,
)

__all__ = [
    "Alert",
    "AuditEvent",
    "Base",
    "Decision",
    "InstanceRow",
    "RequestRecord",
    "Snapshot",
    "SpanRow",
    "StoreError",
    "WeightOverride",
    "make_engine",
    "session_factory",
    "transaction",
]
