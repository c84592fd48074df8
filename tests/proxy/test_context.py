"""A prompt and max_tokens the model's context cannot hold are a 400 before P is called: the length
learnt from the instances' /v1/models (the smallest), the prompt counted by the tokenizer when one is
configured, else by a floor from its bytes that never exceeds the true count."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdscope.config import Settings
from proxy.app import ProxyApp
from proxy.context import MAX_BYTES_PER_TOKEN, Count, token_floor, verdict
from proxy.tokenize import load_tokenizer
from tests.proxy.conftest import fake_fleet, make_settings, running_proxy

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
TOKENIZER = Path(__file__).parents[1] / "fixtures" / "tokenizer"


async def learnt(app: ProxyApp, model: str = "fake", within_s: float = 10.0) -> int:
    """Wait (with a deadline) until the proxy has learnt ``model``'s context length."""
    deadline = time.monotonic() + within_s
    while (n := app.parts.catalog.max_model_len(model)) is None:
        assert time.monotonic() < deadline, "the proxy never learnt max_model_len"
        await asyncio.sleep(0.01)
    return n


def with_tokenizer(settings: Settings) -> Settings:
    return settings.model_copy(
        update={"model": settings.model.model_copy(update={"tokenizer": str(TOKENIZER)})}
    )


def test_the_floor_never_exceeds_the_tokenizers_count() -> None:
    tok = load_tokenizer(str(TOKENIZER))
    texts = ["", "a", "hello world " * 300, "é" * 999, "日本語のテキスト" * 50, " " * 5000, "x\n" * 700]
    for text in texts:
        body = {"prompt": text}
        ids = tok.ids(COMPLETIONS, body)
        floor = token_floor(COMPLETIONS, body)
        assert ids is not None and floor is not None and floor <= len(ids)
        chat = {"messages": [{"role": "user", "content": text}]}
        chat_ids = tok.ids(CHAT, chat)
        assert chat_ids is not None and (token_floor(CHAT, chat) or 0) <= len(chat_ids)


@pytest.mark.parametrize(
    "endpoint,body,floor",
    [
        (COMPLETIONS, {"prompt": "a" * (MAX_BYTES_PER_TOKEN + 1)}, 2),
        (COMPLETIONS, {"prompt": list(range(300))}, 300),
        (COMPLETIONS, {"prompt": [[1, 2], list(range(9))]}, 9),
        (COMPLETIONS, {"prompt": ["a", "b" * 600]}, 3),
        (COMPLETIONS, {"prompt": list(range(300)), "truncate_prompt_tokens": 10}, 10),
        (COMPLETIONS, {"prompt": "x", "truncate_prompt_tokens": -1}, None),
        (COMPLETIONS, {"prompt_embeds": "..."}, None),
        (
            CHAT,
            {
                "messages": [
                    {"role": "system", "content": "s" * 256},
                    {"role": "assistant", "content": "dropped by some templates" * 100},
                    {"role": "user", "content": [{"type": "text", "text": "t" * 257}, {"type": "image_url"}]},
                ]
            },
            3,
        ),
    ],
)
def test_token_floor(endpoint: str, body: dict[str, Any], floor: int | None) -> None:
    assert token_floor(endpoint, body) == floor


def test_the_verdict_names_the_field_and_the_lengths() -> None:
    over = verdict(COMPLETIONS, {"max_tokens": 100}, 4096, Count(4000, True))
    assert over is not None and over.param == "max_tokens"
    assert "4096" in over.message and "4000" in over.message and "100" in over.message
    assert verdict(COMPLETIONS, {"max_tokens": 96}, 4096, Count(4000, True)) is None
    full = verdict(CHAT, {}, 4096, Count(4096, False))
    assert full is not None and full.param == "messages" and "at least 4096" in full.message
    chat = verdict(CHAT, {"max_tokens": 300, "max_completion_tokens": 200}, 4096, Count(4000, True))
    assert chat is not None and chat.param == "max_completion_tokens"
    assert verdict(COMPLETIONS, {"max_tokens": 100}, 4096, Count(4000, True), clamp=True) is None


async def test_seventy_requests_over_the_learnt_context_spend_no_prefill() -> None:
    async with fake_fleet(2, 1) as fleet:
        fleet.prefill[0].max_model_len = 8192
        fleet.prefill[1].max_model_len = 6000
        fleet.decode[0].max_model_len = 4096  # the smallest of the instances serving "fake"
        settings = make_settings([p.url for p in fleet.prefill], [fleet.decode[0].url])
        async with running_proxy(settings) as (url, app), httpx.AsyncClient(timeout=10) as client:
            assert await learnt(app) == 4096
            for _ in range(70):
                resp = await client.post(
                    url + COMPLETIONS, json={"model": "fake", "prompt": list(range(3000)), "max_tokens": 2000}
                )
                assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            ok = await client.post(url + COMPLETIONS, json={"model": "fake", "prompt": "hi", "max_tokens": 4})
            metrics = (await client.get(url + "/metrics")).text
    assert err["param"] == "max_tokens" and "4096" in err["message"] and "3000" in err["message"]
    assert ok.status_code == 200
    assert sum(len(p.calls) for p in fleet.prefill) == 1 and len(fleet.decode[0].calls) == 1
    assert 'pdscope_proxy_context_rejections_total{counted="floor"} 70.0' in metrics
    assert 'pdscope_proxy_requests_total{endpoint="/v1/completions",outcome="client_error"} 70.0' in metrics


async def test_the_tokenizer_counts_what_the_floor_cannot_and_the_override_wins() -> None:
    prompt = "hello world " * 400  # 4,800 bytes: a floor of 19 tokens, far more by the tokenizer
    body = {"model": "fake", "prompt": prompt, "max_tokens": 3900}
    async with fake_fleet(1, 1) as fleet:
        base = make_settings([fleet.prefill[0].url], [fleet.decode[0].url])
        async with running_proxy(base) as (url, app), httpx.AsyncClient(timeout=10) as client:
            await learnt(app)
            assert (await client.post(url + COMPLETIONS, json=body)).status_code == 200  # floor: fits
        async with (
            running_proxy(with_tokenizer(base)) as (url, app),
            httpx.AsyncClient(timeout=10) as client,
        ):
            await learnt(app)
            refused = await client.post(url + COMPLETIONS, json=body)
            metrics = (await client.get(url + "/metrics")).text
        override = make_settings([fleet.prefill[0].url], [fleet.decode[0].url], proxy={"max_model_len": 64})
        async with running_proxy(override) as (url, app), httpx.AsyncClient(timeout=10) as client:
            small = await client.post(url + COMPLETIONS, json={"prompt": list(range(60)), "max_tokens": 8})
    assert refused.status_code == 400 and "at least" not in refused.json()["error"]["message"]
    assert 'pdscope_proxy_context_rejections_total{counted="tokenizer"} 1.0' in metrics
    assert small.status_code == 400 and "64" in small.json()["error"]["message"]
    assert len(fleet.prefill[0].calls) == 1  # only the request that fitted by the floor


async def test_clamp_lets_through_what_vllm_clamps_and_refuses_a_prompt_with_no_room() -> None:
    async with fake_fleet(1, 1) as fleet:
        fleet.decode[0].max_model_len = fleet.prefill[0].max_model_len = 1000
        settings = make_settings(
            [fleet.prefill[0].url], [fleet.decode[0].url], proxy={"max_tokens_overflow": "clamp"}
        )
        async with running_proxy(settings) as (url, app), httpx.AsyncClient(timeout=10) as client:
            await learnt(app)
            clamped = await client.post(
                url + COMPLETIONS, json={"prompt": list(range(900)), "max_tokens": 500}
            )
            full = await client.post(url + COMPLETIONS, json={"prompt": list(range(1000)), "max_tokens": 1})
    assert clamped.status_code == 200
    assert full.status_code == 400 and full.json()["error"]["param"] == "prompt"
    assert len(fleet.prefill[0].calls) == 1


async def test_the_check_hands_the_tokenizers_exact_count_to_the_predictor() -> None:
    """With a tokenizer the check counts the prompt exactly: that count, not a text estimate, is the
    one the TTFT predictor is given (the flow's ``req.tokens``)."""
    from proxy.context import ContextCheck
    from proxy.models import ModelCatalog

    tok = load_tokenizer(str(TOKENIZER))
    body = {"model": "fake", "prompt": "hello world " * 40, "max_tokens": 8}
    ids = tok.ids(COMPLETIONS, body)
    assert ids is not None
    counted = ContextCheck(ModelCatalog(), override=4096, tokenizer=tok)
    assert await counted.check(COMPLETIONS, body, 480, None) == len(ids)
    assert await ContextCheck(ModelCatalog(), override=4096).check(COMPLETIONS, body, 480, None) is None
