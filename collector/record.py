"""The request record: one typed field per ``request_records`` column, and which writer owns it.

Two writers share a ``store.models.RequestRecord`` row, and each column has one owner:

- **assembly** owns every field of ``AssembledRecord``: ``collector.assemble`` builds it from
  a trace's spans and ``collector.sink`` writes it, inserting a row (``insert_row``) or
  updating one (``AssembledRecord.update``), never touching the other owner's part;
- **forensics** (``collector.forensics``) owns ``FORENSICS_COLUMNS`` and, inside the shared
  ``attributes`` JSON, the keys ``FORENSICS_KEYS``; it sets them only through
  ``note_forensics`` and ``flag_lease_expiry`` on rows detached from its session, and stores
  them with ``store_forensics``: a compare-and-set on the row's ``stamp``, so a re-assembly
  committed between forensics' read and its write is merged, never overwritten.

The shared ``attributes`` column is split by key: assembly's keys are ``AssemblyNotes``'
(``ASSEMBLY_KEYS``), merged over what the row holds, so forensics' keys survive a
re-assembly. Importing this module checks that the two parts are disjoint and together
cover every column of the table (``OwnershipError`` otherwise).

The SLO verdict columns are derived, never observed: ``pdscope.slo.slo_verdict`` computes
them from the status and the stage durations (``ttft_s``, ``tpot_s``) under the ``slo``
settings in force; readers that follow a changed ``slo.*`` recompute them with the same rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Final, Literal

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from store.models import RequestRecord


class OwnershipError(RuntimeError):
    """The record's columns are not split into exactly one owner each."""


# -- assembly's part ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VllmSide:
    """What the record keeps of one vLLM ``llm_request`` span (P's or D's)."""

    request_id: str | None
    ttft_s: float | None


@dataclass(frozen=True, slots=True)
class AssemblyNotes:
    """Assembly's keys in ``RequestRecord.attributes``."""

    spans: int  # spans of the trace the record was assembled from
    p_vllm: VllmSide | None = None
    d_vllm: VllmSide | None = None
    reject_reason: str | None = None
    remote_engine_id: str | None = None
    # root attributes that were present but not valid (out of range, not hex, an unknown route
    # path), left out of the record; the sink counts them (pdscope_collector_record_attributes_dropped)
    dropped: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The keys as stored: a vLLM side's keys only with its span, a reason only when given."""
        out: dict[str, Any] = {"spans": self.spans}
        if self.p_vllm is not None:
            out["p_vllm_request_id"] = self.p_vllm.request_id
        if self.d_vllm is not None:
            out["d_vllm_request_id"] = self.d_vllm.request_id
            out["d_ttft_s"] = self.d_vllm.ttft_s
        if self.reject_reason:
            out["reject_reason"] = self.reject_reason
        if self.remote_engine_id:
            out["remote_engine_id"] = self.remote_engine_id
        if self.dropped:
            out["dropped_attributes"] = list(self.dropped)
        return out


ASSEMBLY_KEYS: Final = frozenset(
    {
        "spans",
        "p_vllm_request_id",
        "d_vllm_request_id",
        "d_ttft_s",
        "reject_reason",
        "remote_engine_id",
        "dropped_attributes",
    }
)


@dataclass(frozen=True, slots=True)
class AssembledRecord:
    """Assembly's columns of one ``RequestRecord``: one field per column, coerced to its type."""

    request_id: str
    trace_id: str
    endpoint: str | None
    stream: bool | None
    p_instance: str | None
    d_instance: str | None
    p_pool: str | None
    d_pool: str | None
    status: str
    http_status: int | None
    error: str | None
    retries: int
    prompt_tokens: int | None
    completion_tokens: int | None
    kv_blocks: int | None
    kv_bytes: int | None
    # KV-aware routing, from the root (see collector.assemble.routing)
    route_path: str | None
    p_predicted_cached_tokens: int | None
    d_predicted_cached_tokens: int | None
    p_cached_tokens: int | None
    d_cached_tokens: int | None
    prefix_key: str | None
    prefix_tokens: int | None
    handoff: str | None  # pull, push or push_early (semconv.HANDOFFS); None: no handoff, or an older proxy
    # stage timestamps, Unix seconds
    proxy_in: float
    p_sent: float | None
    p_done: float | None
    d_sent: float | None
    first_token: float | None
    done: float | None
    # durations measured inside vLLM
    p_queue_s: float | None
    p_prefill_s: float | None
    d_queue_s: float | None
    d_prefill_s: float | None
    d_decode_s: float | None
    # derived from the stages
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    slo_ttft_met: bool | None
    slo_tpot_met: bool | None
    slo_met: bool
    attributes: AssemblyNotes
    sender: str | None
    # the proxy's TTFT predictor, from the root (see collector.predicted); last, with defaults, so a
    # record built without a predictor leaves them null
    predicted_ttft_s: float | None = None
    ttft_target_s: float | None = None
    predict_tokens_ahead: int | None = None
    predict_tokens: int | None = None
    predict_source: str | None = None
    # whose request it was (collector.tenant: a declared tenant id; None: absent or refused, "default"'s)
    tenant: str | None = None

    def row(self) -> dict[str, Any]:
        """Column name -> value, ``attributes`` as stored (assembly's keys only)."""
        out = {name: getattr(self, name) for name in ASSEMBLED_COLUMNS}
        out["attributes"] = self.attributes.to_json()
        return out

    def insert_row(self) -> dict[str, Any]:
        """The values of a new row: assembly's columns and forensics' part as it starts."""
        return {**self.row(), **FORENSICS_INITIAL}

    def update(self, rec: RequestRecord) -> None:
        """Write assembly's columns into a stored row: only the changed ones (no needless UPDATE).

        ``attributes`` is merged: assembly's keys over what the row holds (forensics' keys stay).
        """
        for name in ASSEMBLED_COLUMNS:
            if name == "attributes":
                merged = {**(rec.attributes or {}), **self.attributes.to_json()}
                if merged != rec.attributes:
                    rec.attributes = merged
                continue
            value = getattr(self, name)
            if getattr(rec, name) != value:
                setattr(rec, name, value)


ASSEMBLED_COLUMNS: Final = tuple(f.name for f in fields(AssembledRecord))


# -- forensics' part ---------------------------------------------------------------------------

ForensicsKey = Literal["nixl", "failed_attempts", "lease_expiry"]
FORENSICS_COLUMNS: Final = frozenset({"lease_expiry_suspect"})
FORENSICS_KEYS: Final = frozenset({"nixl", "failed_attempts", "lease_expiry"})
FORENSICS_INITIAL: Final[dict[str, Any]] = {"lease_expiry_suspect": False}


def note_forensics(rec: RequestRecord, key: ForensicsKey, value: Any) -> None:
    """Set one of forensics' keys in the row's ``attributes`` (a new dict, so the ORM sees the change)."""
    if key not in FORENSICS_KEYS:
        raise KeyError(f"{key!r} is not a forensics key of a request record")
    rec.attributes = {**(rec.attributes or {}), key: value}


def forensics_part(rec: RequestRecord) -> tuple[bool, dict[str, Any]]:
    """What forensics owns of a row: its flag and its keys of ``attributes``."""
    attrs = rec.attributes or {}
    return bool(rec.lease_expiry_suspect), {k: attrs[k] for k in FORENSICS_KEYS if k in attrs}


def store_forensics(
    session: Session, records: Iterable[RequestRecord], before: Mapping[int, tuple[bool, dict[str, Any]]]
) -> int:
    """Write forensics' part of each record changed since ``before`` (its ``forensics_part`` when
    read, by row id); returns how many rows were written.

    The records were read without a lock and set while detached. Each is written only if its
    ``stamp`` is still the one read; otherwise the row is read again (locked) and forensics' part
    is merged over what it holds now, so a key assembly wrote in between is kept.
    """
    written = 0
    for rec in records:
        part = forensics_part(rec)
        if part == before.get(rec.id):
            continue
        flag, keys = part
        row = update(RequestRecord).where(RequestRecord.id == rec.id)
        unchanged = RequestRecord.stamp.is_(None) if rec.stamp is None else RequestRecord.stamp == rec.stamp
        done = session.execute(
            row.where(unchanged).values(attributes=dict(rec.attributes or {}), lease_expiry_suspect=flag)
        )
        if not done.rowcount:  # type: ignore[attr-defined]
            # changed since read. The conditional write above began the write (SQLite serialises
            # from here on); PostgreSQL's lock holds the row until the commit.
            now = session.execute(
                select(RequestRecord.id, RequestRecord.attributes)
                .where(RequestRecord.id == rec.id)
                .with_for_update()
            ).first()
            if now is None:  # removed since read (retention): nothing to note
                continue
            merged = {**(now.attributes or {}), **keys}
            session.execute(row.values(attributes=merged, lease_expiry_suspect=flag))
        written += 1
    return written


def flag_lease_expiry(rec: RequestRecord, entry: dict[str, Any]) -> None:
    """Attribute one expired lease to the row: append ``entry`` to ``lease_expiry`` and flag it."""
    entries = list((rec.attributes or {}).get("lease_expiry") or [])
    entries.append(entry)
    note_forensics(rec, "lease_expiry", entries)
    rec.lease_expiry_suspect = True


# -- one owner per column ----------------------------------------------------------------------


def check_owners(table_columns: frozenset[str]) -> None:
    """Raise OwnershipError unless assembly's and forensics' parts split ``table_columns`` exactly."""
    assembly, forensics = frozenset(ASSEMBLED_COLUMNS), FORENSICS_COLUMNS
    both = assembly & forensics
    missing = table_columns - assembly - forensics
    unknown = (assembly | forensics) - table_columns
    shared = ASSEMBLY_KEYS & FORENSICS_KEYS
    if both or missing or unknown or shared or frozenset(FORENSICS_INITIAL) != forensics:
        raise OwnershipError(
            f"request record columns: owned twice {sorted(both)}, unowned {sorted(missing)}, "
            f"not in the table {sorted(unknown)}, attribute keys owned twice {sorted(shared)}"
        )


# the database's own: the row id, and the change stamp its triggers write (migration 0017)
DATABASE_COLUMNS: Final = frozenset({"id", "stamp"})
RECORD_COLUMNS: Final = frozenset(
    c.name for c in RequestRecord.__table__.columns if c.name not in DATABASE_COLUMNS
)
check_owners(RECORD_COLUMNS)
