"""Shapes of vLLM's OpenAI-compatible API that pdscope serves as vLLM does (the simulator as an
instance, the proxy in front of both pools), so the two cannot drift apart."""

from __future__ import annotations

from typing import Any


def model_card(
    model_id: str,
    *,
    created: int,
    max_model_len: int | None,
    permission_id: str,
    owned_by: str = "vllm",
    root: str | None = None,
    parent: str | None = None,
) -> dict[str, Any]:
    """One entry of ``GET /v1/models``'s ``data``, as vLLM answers it."""
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": owned_by,
        "root": root if root is not None else model_id,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": f"modelperm-{permission_id}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }
