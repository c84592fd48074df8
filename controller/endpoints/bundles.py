"""Incident bundles on the controller's host: ``GET /v1/bundles`` lists them, ``GET /v1/bundles/<name>``
downloads one (see :mod:`controller.bundle`). Reads, open like the other reads: a bundle holds the
same request records, decisions and alerts the other read endpoints serve."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, HTTPException, Request
from fastapi import Path as PathParam
from fastapi.responses import FileResponse

from controller.bundle import list_bundles
from controller.bundlepack import is_bundle_name
from controller.endpoints.context import ApiContext
from controller.schemas import BundleOut, BundlesOut


def router(ctx: ApiContext) -> APIRouter:
    r = APIRouter()
    reconciler = ctx.reconciler

    def folder() -> Path:
        return reconciler.bundler.folder or Path(reconciler.settings.controller.bundles.dir).resolve()

    @r.get(
        "/v1/bundles",
        response_model=BundlesOut,
        tags=["alerts"],
        summary="The incident bundles in controller.bundles.dir, newest first",
    )
    def get_bundles(request: Request) -> BundlesOut:
        base = str(request.base_url).rstrip("/")
        return BundlesOut(
            enabled=reconciler.bundler.folder is not None,
            dir=str(folder()),
            bundles=[
                BundleOut(name=b.name, bytes=b.bytes, mtime=b.mtime, url=f"{base}/v1/bundles/{b.name}")
                for b in list_bundles(folder())
            ],
        )

    @r.get(
        "/v1/bundles/{name}",
        tags=["alerts"],
        response_class=FileResponse,
        summary="One incident bundle (application/gzip); 404 when there is none of that name",
    )
    def get_bundle(name: Annotated[str, PathParam(max_length=260)]) -> FileResponse:
        path = folder() / name
        if not is_bundle_name(name) or not path.is_file():
            raise HTTPException(404, detail=f"no bundle named {name[:80]!r}")
        return FileResponse(path, media_type="application/gzip", filename=name)

    return r
