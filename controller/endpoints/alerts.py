"""Alerts (stored states), the built-in rules as configured, and the SLO status over the window."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from sqlalchemy import select

from controller.endpoints.context import ApiContext
from controller.loop import Reconciler
from controller.schemas import AlertOut, AlertRuleOut, SLOOut
from store.db import transaction
from store.models import Alert


def router(ctx: ApiContext) -> APIRouter:
    r = APIRouter()
    reconciler = ctx.reconciler

    @r.get("/v1/alerts", response_model=list[AlertOut], tags=["alerts"])
    def get_alerts(
        state: Literal["active", "pending", "firing", "resolved", "all"] = "active",
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[AlertOut]:
        stmt = select(Alert).order_by(Alert.last_eval.desc(), Alert.id.desc()).limit(limit)
        if state == "active":
            stmt = stmt.where(Alert.state.in_(("pending", "firing")))
        elif state != "all":
            stmt = stmt.where(Alert.state == state)
        with transaction(reconciler.factory) as session:
            return [AlertOut.model_validate(a, from_attributes=True) for a in session.scalars(stmt)]

    @r.get("/v1/alerts/rules", response_model=list[AlertRuleOut], tags=["alerts"])
    def get_alert_rules() -> list[AlertRuleOut]:
        return [
            AlertRuleOut(
                name=x.name, severity=x.severity, for_s=x.for_s, enabled=x.enabled, summary=x.summary
            )
            for x in reconciler.rules
        ]

    @r.get("/v1/slo", response_model=SLOOut, tags=["alerts"])
    def get_slo() -> SLOOut:
        return slo_status(reconciler)

    return r


def slo_status(reconciler: Reconciler) -> SLOOut:
    """The SLO targets against what the latest observation saw; ``ok`` only with enough requests."""
    cfg = reconciler.cfg
    obs = reconciler.view().obs
    slo = obs.slo if obs is not None else None
    ttft = slo.ttft_at_slo_s if slo else None
    tpot = slo.tpot_at_slo_s if slo else None
    att = slo.attainment if slo else None
    enough = slo is not None and slo.completed >= reconciler.alert_config.min_requests
    ok = None
    if enough and slo is not None and ttft is not None and att is not None:
        ok = (
            ttft <= cfg.ttft_target_s
            and (tpot is None or tpot <= cfg.tpot_target_s)
            and (att >= cfg.goodput_attainment)
        )
    return SLOOut(
        window_s=reconciler.settings.slo.window_s,
        ttft_target_ms=cfg.ttft_target_s * 1000,
        ttft_percentile=cfg.ttft_percentile,
        ttft_observed_ms=None if ttft is None else ttft * 1000,
        tpot_target_ms=cfg.tpot_target_s * 1000,
        tpot_percentile=cfg.tpot_percentile,
        tpot_observed_ms=None if tpot is None else tpot * 1000,
        goodput_attainment_target=cfg.goodput_attainment,
        attainment=att,
        goodput_rps=slo.goodput_rps if slo else 0.0,
        completed=slo.completed if slo else 0,
        met=slo.met if slo else 0,
        rejected=slo.rejected if slo else 0,
        handoff_p99_ms=None if slo is None or slo.handoff_p99_s is None else slo.handoff_p99_s * 1000,
        handoff_budget_ms=cfg.handoff_budget_s * 1000,
        ok=ok,
        evaluated_at=None if obs is None else obs.now,
    )
