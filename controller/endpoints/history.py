"""The policy's stored decisions, newest first (what changed, why, with its arithmetic), and the
policy configs they were taken under."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query
from sqlalchemy import select

from controller.endpoints.context import MAX_UNIX_S, ApiContext
from controller.schemas import DecisionOut, PolicyOut
from store.db import transaction
from store.models import Decision, PolicyConfigRow


def router(ctx: ApiContext) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/decisions", response_model=list[DecisionOut], tags=["history"])
    def get_decisions(
        subject: str | None = None,
        field: str | None = None,
        since: Annotated[float | None, Query(ge=0, le=MAX_UNIX_S, description="Unix seconds")] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[DecisionOut]:
        stmt = select(Decision).order_by(Decision.id.desc()).limit(limit)
        if subject is not None:
            stmt = stmt.where(Decision.subject == subject)
        if field is not None:
            stmt = stmt.where(Decision.field == field)
        if since is not None:
            stmt = stmt.where(Decision.ts >= since)
        with transaction(ctx.reconciler.factory) as session:
            return [DecisionOut.model_validate(d, from_attributes=True) for d in session.scalars(stmt)]

    @r.get(
        "/v1/policy",
        response_model=PolicyOut,
        tags=["history"],
        summary="The policy config this controller runs under (every threshold)",
    )
    def get_policy() -> PolicyOut:
        cfg = ctx.reconciler.cfg
        fp = cfg.fingerprint()
        return PolicyOut(fingerprint=fp, version=int(fp[1:].split(":")[0]), config=cfg.as_dict())

    @r.get(
        "/v1/policy/{fingerprint}",
        response_model=PolicyOut,
        tags=["history"],
        summary="A stored policy config, as named by a decision's policy field",
    )
    def get_stored_policy(fingerprint: str) -> PolicyOut:
        with transaction(ctx.reconciler.factory) as session:
            row = session.get(PolicyConfigRow, fingerprint)
            if row is None:
                raise HTTPException(404, detail=f"no stored policy config {fingerprint!r}")
            return PolicyOut(
                fingerprint=row.fingerprint,
                version=row.version,
                config=dict(row.config),
                first_seen=row.first_seen,
            )

    return r
