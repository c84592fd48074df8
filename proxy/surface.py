"""The rest of the surface a vLLM client expects of the proxy: ``GET /v1/models``, ``GET /health``
(and ``/ping``), ``GET /version``, and a clear refusal of every other vLLM route.

- ``/v1/models``: the models that both roles serve (at least one P and one D list it), in vLLM's
  shape (``{"object": "list", "data": [{"id", "object": "model", "created", "owned_by", "root",
  "parent", "max_model_len", "permission"}]}``), ``max_model_len`` the smallest any instance serving
  the model reports (:class:`proxy.models.ModelCatalog`).
- ``/health``: 200 when the proxy can route -- at least one P and one D believed up: in the routing
  view (not drained, weight above 0), not ejected by outlier detection, and not unreachable at the
  catalog's last ask -- else 503 with the reason. ``/healthz`` stays the proxy's own detailed state.
- ``/version``: the proxy's version, and the vLLM versions each role's instances reported.
- Any other route (``/tokenize``, ``/detokenize``, ``/v1/embeddings``, ``/pooling``,
  ``/v1/audio/...``, vLLM's ``/metrics`` ...): 404, a JSON error naming the route and what the proxy
  serves. The proxy's ``/metrics`` is its own; an instance's is read from the instance.

Pure: bodies from the state passed in; the app writes them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from pdscope import __version__
from pdscope.vllmapi import model_card
from proxy.models import ModelCard, ModelCatalog
from proxy.outlier import OutlierDetector
from proxy.routing import RoutingView, Target

SERVED = (
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "GET /v1/models",
    "GET /health",
    "GET /version",
    "GET /healthz",
    "GET /metrics",
)
# method -> paths answered here (besides the two generation endpoints, which the app routes)
SURFACE: dict[str, tuple[str, ...]] = {
    "GET": ("/v1/models", "/health", "/ping", "/version"),
    "POST": ("/ping",),
}


def _card(card: ModelCard) -> dict[str, Any]:
    return model_card(
        card.id,
        created=card.created,
        max_model_len=card.max_model_len,
        permission_id=uuid.uuid5(uuid.NAMESPACE_URL, "pdscope-proxy/" + card.id).hex,
        owned_by=card.owned_by,
        root=card.root,
        parent=card.parent,
    )


def models_body(catalog: ModelCatalog) -> bytes:
    return json.dumps({"object": "list", "data": [_card(c) for c in catalog.served()]}).encode()


def _up(targets: Sequence[Target], outliers: OutlierDetector, catalog: ModelCatalog, now: float) -> int:
    return sum(1 for t in targets if not outliers.is_ejected(t.name, now) and not catalog.unreachable(t.name))


def health(
    view: RoutingView, outliers: OutlierDetector, catalog: ModelCatalog, now: float
) -> tuple[int, bytes]:
    """(200 or 503, a small JSON saying how many of each role are believed up)."""
    p, d = _up(view.prefill, outliers, catalog, now), _up(view.decode, outliers, catalog, now)
    body: dict[str, Any] = {"status": "ok" if p and d else "unavailable", "prefill_up": p, "decode_up": d}
    if not (p and d):
        body["reason"] = "no prefill instance believed up" if not p else "no decode instance believed up"
    return (200 if p and d else 503), json.dumps(body).encode()


def version_body(catalog: ModelCatalog) -> bytes:
    return json.dumps(
        {"version": __version__, "server": "pdscope-proxy", "vllm": catalog.versions()}
    ).encode()


def not_served(method: str, path: str) -> bytes:
    """The 404 body for a route the proxy does not serve: it names the route and what is served."""
    shown = path if len(path) <= 200 else path[:200] + "..."
    return json.dumps(
        {
            "error": {
                "message": (
                    f"{method} {shown} is not served by the pdscope proxy: it serves only completions and "
                    f"chat completions ({', '.join(SERVED)}); send other vLLM routes to an instance"
                ),
                "type": "not_found_error",
                "param": None,
                "code": "route_not_served",
            }
        }
    ).encode()
