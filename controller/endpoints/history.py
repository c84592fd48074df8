"""The policy's stored decisions, newest first (what changed, why, with its arithmetic)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from sqlalchemy import select

from controller.endpoints.context import ApiContext
from controller.schemas import DecisionOut
from store.db import transaction
from store.models import Decision


def router(ctx: ApiContext) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/decisions", response_model=list[DecisionOut], tags=["history"])
    def get_decisions(
        subject: str | None = None,
        field: str | None = None,
        since: Annotated[float | None, Query(description="Unix seconds")] = None,
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

    return r
