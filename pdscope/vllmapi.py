"""Shapes of vLLM's OpenAI-compatible API that pdscope serves as vLLM does (the simulator as an
instance, the proxy in front of both pools), so the two cannot drift apart; the
``kv_transfer_params`` that ask a P for a NIXL prefill (the proxy's, the simulator's direct load);
and the bucket bounds of vLLM's latency histograms on ``/metrics`` (the simulator's, the seeded
history's)."""

from __future__ import annotations

from typing import Any, Final

# What a prefill request carries in ``kv_transfer_params`` (vLLM's NIXL pull protocol): P computes
# the prompt, keeps its blocks for a D to pull and answers with where they are. Copy it before use.
PREFILL_KV_PARAMS: Final[dict[str, Any]] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# vLLM's histogram bucket bounds, in seconds (vllm:time_to_first_token_seconds,
# vllm:inter_token_latency_seconds, vllm:nixl_xfer_time_seconds).
TTFT_BUCKETS: Final = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
ITL_BUCKETS: Final = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5),
    *(0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
NIXL_XFER_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)


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
