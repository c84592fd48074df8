"""Incident bundles on the controller's host: ``GET /v1/bundles`` lists them, ``GET /v1/bundles/<name>``
downloads one (see :mod:`controller.bundle`). Reads, open like the other reads: a bundle holds the
same request records, decisions and alerts the other read endpoints serve.

Only a regular file directly in the folder is served (:func:`controller.bundle.open_bundle`): a
symlink (even to a file inside), a path, ``..`` or anything not a regular file is a 404, counted in
``pdscope_controller_bundle_refusals_total{reason}`` (a link or non-file also logged: someone put
it there)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Annotated

from fastapi import APIRouter, HTTPException, Request
from fastapi import Path as PathParam
from fastapi.responses import StreamingResponse
from prometheus_client import Counter

from controller.bundle import BundleRefused, list_bundles, open_bundle
from controller.endpoints.context import ApiContext
from controller.schemas import BundleOut, BundlesOut

log = logging.getLogger(__name__)
CHUNK = 256 * 1024


def _chunks(f: IO[bytes]) -> Iterator[bytes]:
    try:
        while chunk := f.read(CHUNK):
            yield chunk
    finally:
        f.close()


def router(ctx: ApiContext) -> APIRouter:
    r = APIRouter()
    reconciler = ctx.reconciler
    refused = Counter(
        "pdscope_controller_bundle_refusals",
        "Bundle downloads refused (404) by reason: bad_name, missing, symlink, not_a_file",
        ["reason"],
        registry=ctx.registry,
    )

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
        response_class=StreamingResponse,
        summary="One incident bundle (application/gzip); 404 when there is none of that name "
        "(a symlink or anything but a regular file in controller.bundles.dir is none)",
    )
    def get_bundle(name: Annotated[str, PathParam(max_length=260)]) -> StreamingResponse:
        try:
            f, size = open_bundle(folder(), name)
        except BundleRefused as exc:
            refused.labels(exc.reason).inc()
            if exc.reason in ("symlink", "not_a_file"):
                log.warning("bundle %r not served: a %s in %s", name[:80], exc.reason, folder())
            raise HTTPException(404, detail=f"no bundle named {name[:80]!r}") from None
        headers = {"Content-Length": str(size), "Content-Disposition": f'attachment; filename="{name}"'}
        return StreamingResponse(_chunks(f), media_type="application/gzip", headers=headers)

    return r
