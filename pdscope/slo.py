"""The SLO verdict of one request: derived from its status and stage durations, never observed.

The collector stores a verdict with each record (``slo_ttft_met``, ``slo_tpot_met``,
``slo_met``) under the ``slo.*`` settings in force when it assembled it; readers that must
follow a changed ``slo.*`` (the controller's SLO figures, the dashboard's SLO counts)
recompute it from the stored ``status``, ``ttft_s`` and ``tpot_s`` with the same rule, in
Python (:func:`slo_verdict`) or in SQL (``store.queries.slo_met_clause``).

Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdscope.config import SLOSettings


@dataclass(frozen=True, slots=True)
class SLOVerdict:
    """``slo_ttft_met``, ``slo_tpot_met`` and ``slo_met`` of one record."""

    ttft_met: bool | None
    tpot_met: bool | None
    met: bool


def slo_verdict(
    status: str | None, ttft_s: float | None, tpot_s: float | None, slo: SLOSettings
) -> SLOVerdict:
    """The verdict for these figures under ``slo``.

    No TTFT: the TTFT verdict is unknown. No TPOT (one token, or none measured) with a TTFT:
    the TPOT SLO is met. ``met`` needs status ``ok`` and both SLOs met.
    """
    ttft_met = None if ttft_s is None else ttft_s * 1000.0 <= slo.ttft.target_ms
    if tpot_s is None:
        tpot_met = True if ttft_s is not None else None
    else:
        tpot_met = tpot_s * 1000.0 <= slo.tpot.target_ms
    return SLOVerdict(ttft_met, tpot_met, status == "ok" and bool(ttft_met) and bool(tpot_met))
