"""A stored request record as SLO-miss attribution reads it: its row, and the forensics the collector
joined to it (the D's NIXL figures over its handoff, the leases it left waiting, its failed attempts),
into a :class:`analysis.attribution.StageRecord`.

Pure: the row is any object with the columns ``store.attribution.STAGE_COLUMNS`` names, read by
the controller (``controller.attribution``) and by the dashboard (``dashboard.queries.investigate``)
alike, so the two answer the same. Untrusted JSON (``attributes``) is read defensively: a field of the
wrong type is as good as absent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from analysis.attribution import Attempt, StageRecord


def _num(x: object) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) else None


def _nixl_transfers(attributes: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """Forensics' ``nixl`` figures of the side that recorded the handoff's transfers: D's (pull mode),
    or P's (``transfers_on: p``, push mode)."""
    nixl = (attributes or {}).get("nixl")
    if not isinstance(nixl, dict):
        return {}
    side = nixl.get(nixl.get("transfers_on") if nixl.get("transfers_on") in ("d", "p") else "d")
    return side if isinstance(side, dict) else {}


def transfer_failed(attributes: Mapping[str, Any] | None) -> bool:
    """A NIXL transfer failed during this request's handoff (forensics' ``nixl`` join), on the side that
    records the transfers."""
    n = _num(_nixl_transfers(attributes).get("nixl_failed_transfers"))
    return n is not None and n > 0


def _transfer_s(attributes: Mapping[str, Any] | None) -> float | None:
    """The mean NIXL transfer time over the scrape window of this request's handoff (D's reads, or in
    push mode P's writes)."""
    d = _nixl_transfers(attributes)
    n, total = _num(d.get("nixl_xfer_time_count")), _num(d.get("nixl_xfer_time_sum"))
    return total / n if n is not None and total is not None and n > 0 and total >= 0 else None


def _lease_ds(attributes: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The D's the record's expired leases were waiting on (forensics' ``lease_expiry``)."""
    entries = (attributes or {}).get("lease_expiry")
    if not isinstance(entries, list):
        return ()
    return tuple(
        sorted(
            {e["d_instance"] for e in entries if isinstance(e, dict) and isinstance(e.get("d_instance"), str)}
        )
    )


def _attempts(attributes: Mapping[str, Any] | None, failures: FailureSteps) -> tuple[Attempt, ...]:
    """The record's failed attempts (forensics' ``failed_attempts``), a decode attempt marked when its D
    counted NIXL failures while it ran."""
    raw = (attributes or {}).get("failed_attempts")
    out: list[Attempt] = []
    for a in raw if isinstance(raw, list) else []:
        if not isinstance(a, dict):
            continue
        stage, inst, kind = a.get("stage"), a.get("instance"), a.get("kind")
        start, end = _num(a.get("start")), _num(a.get("end"))
        if stage not in ("prefill", "decode") or not isinstance(inst, str) or start is None or end is None:
            continue
        p = a.get("p_instance")
        out.append(
            Attempt(
                stage,
                inst,
                kind if isinstance(kind, str) else "error",
                start,
                end,
                p if isinstance(p, str) else None,
                stage == "decode" and failures.rose(inst, start, end),
            )
        )
    return tuple(sorted(out, key=lambda x: x.start))


@dataclass(frozen=True)
class FailureSteps:
    """The steps of the D's ``nixl_failed_transfers`` counter: did a D count failures in a time span?"""

    steps: Mapping[str, tuple[tuple[float, float], ...]]

    def rose(self, instance: str, start: float, end: float) -> bool:
        """A step of ``instance`` overlaps [start, end] (one scrape interval either side, at most)."""
        return any(lo <= end and hi >= start for lo, hi in self.steps.get(instance, ()))


def _handoff_failed(row: Any, failures: FailureSteps) -> bool:
    """The NIXL join says a transfer failed on the D during the handoff; or, a failed request's handoff
    not joined yet, its D's failure counter rose in a scrape step overlapping it."""
    if "nixl" in (row.attributes or {}):
        return transfer_failed(row.attributes)
    end = row.first_token if row.first_token is not None else row.done
    return (
        row.status != "ok"
        and row.d_instance is not None
        and row.p_done is not None
        and end is not None
        and failures.rose(row.d_instance, row.p_done, end)
    )


def stage_record(row: Any, failures: FailureSteps) -> StageRecord:
    """A stored record's row (``store.attribution.STAGE_COLUMNS``) as the attribution reads it."""
    return StageRecord(
        request_id=row.request_id,
        proxy_in=row.proxy_in,
        status=row.status,
        p_instance=row.p_instance,
        d_instance=row.d_instance,
        p_sent=row.p_sent,
        p_done=row.p_done,
        d_sent=row.d_sent,
        first_token=row.first_token,
        done=row.done,
        p_queue_s=row.p_queue_s,
        ttft_s=row.ttft_s,
        tpot_s=row.tpot_s,
        completion_tokens=row.completion_tokens,
        lease_expired=bool(row.lease_expiry_suspect),
        transfer_failed=_handoff_failed(row, failures),
        retries=row.retries or 0,
        lease_expired_ds=_lease_ds(row.attributes),
        attempts=_attempts(row.attributes, failures) if row.retries else (),
        transfer_s=_transfer_s(row.attributes),
        error=row.error if isinstance(row.error, str) else None,
    )
