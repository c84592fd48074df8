"""A request's prompt as the cache views read it: what is keyed, what is refused and why."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.prompts import CHAT, COMPLETIONS, MESSAGE_OVERHEAD, Chat, Ids, Refused, Text, kept, prompt_of

USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("body", "want"),
    [
        ({"prompt": "hello"}, Text("hello")),
        ({"prompt": ""}, Text("")),
        ({"prompt": ["hello"]}, Text("hello")),  # a batch of one
        ({"prompt": [1, 2, 3]}, Ids([1, 2, 3])),
        ({"prompt": [[1, 2, 3]]}, Ids([1, 2, 3])),
        ({"prompt": [0, 2**32 - 1]}, Ids([0, 2**32 - 1])),
        ({"prompt": ["a", "b"]}, Refused("batch")),
        ({"prompt": [[1], [2]]}, Refused("batch")),
        ({"prompt": [1, -1]}, Refused("shape")),  # not a token id
        ({"prompt": [1, 2**32]}, Refused("shape")),
        ({"prompt": [True, 2]}, Refused("shape")),  # a JSON boolean is not an id
        ({"prompt": [1.0, 2]}, Refused("shape")),
        ({"prompt": []}, Refused("shape")),
        ({"prompt": None}, Refused("shape")),
        ({}, Refused("shape")),
        ({"prompt": 7}, Refused("shape")),
        ({"prompt": "x", "prompt_embeds": "AAAA"}, Refused("embeds")),
        ({"prompt": "x", "cache_salt": "tenant-a"}, Refused("cache_salt")),
        ({"prompt": "x", "cache_salt": None}, Text("x")),
    ],
)
def test_completion_prompts(body: dict[str, Any], want: object) -> None:
    assert prompt_of(COMPLETIONS, body) == want


def parts(*items: dict[str, Any]) -> list[dict[str, Any]]:
    return list(items)


@pytest.mark.parametrize(
    ("messages", "want"),
    [
        ([USER], Chat([USER])),
        ([{"role": "assistant", "content": None}], Chat([{"role": "assistant", "content": None}])),
        (
            [
                {
                    "role": "user",
                    "content": parts({"type": "text", "text": "a"}, {"type": "text", "text": "b"}),
                }
            ],
            Chat([{"role": "user", "content": "a\nb"}]),
        ),
        (
            [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}],  # other fields kept
            Chat([{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]),
        ),
        (
            [{"role": "user", "content": parts({"type": "image_url", "image_url": {"url": "data:"}})}],
            Refused("multimodal"),
        ),
        ([{"role": "user", "content": parts({"type": "text", "text": 3})}], Refused("shape")),
        ([{"role": "user", "content": parts({"text": "no type"})}], Refused("shape")),
        ([{"role": "user", "content": ["bare string"]}], Refused("shape")),
        ([{"role": "user", "content": 5}], Refused("shape")),
        ([{"content": "no role"}], Refused("shape")),
        (["not an object"], Refused("shape")),
        ([], Refused("shape")),
        ("not a list", Refused("shape")),
    ],
)
def test_chat_prompts(messages: Any, want: object) -> None:
    assert prompt_of(CHAT, {"messages": messages}) == want


def test_chat_refusals_that_are_not_about_the_messages() -> None:
    assert prompt_of(CHAT, {"messages": [USER], "continue_final_message": True}) == Refused(
        "continue_final_message"
    )
    assert prompt_of(CHAT, {"messages": [USER], "continue_final_message": False}) == Chat([USER])
    assert prompt_of(CHAT, {"messages": [USER], "cache_salt": "s"}) == Refused("cache_salt")
    assert prompt_of("/v1/embeddings", {"input": "x"}) == Refused("endpoint")


def test_the_message_is_copied_not_shared_with_the_body() -> None:
    msg = {"role": "user", "content": parts({"type": "text", "text": "a"})}
    got = prompt_of(CHAT, {"messages": [msg]})
    assert isinstance(got, Chat)
    assert msg["content"] == [{"type": "text", "text": "a"}]  # the body forwarded upstream is untouched


@pytest.mark.parametrize(
    ("endpoint", "body", "limit", "refused"),
    [
        (COMPLETIONS, {"prompt": "x" * 100}, 100, False),
        (COMPLETIONS, {"prompt": "x" * 101}, 100, True),
        (COMPLETIONS, {"prompt": list(range(100))}, 100, False),
        (COMPLETIONS, {"prompt": list(range(101))}, 100, True),
        (CHAT, {"messages": [{"role": "user", "content": "x" * (100 - MESSAGE_OVERHEAD)}]}, 100, False),
        (CHAT, {"messages": [{"role": "user", "content": "x" * (101 - MESSAGE_OVERHEAD)}]}, 100, True),
        (CHAT, {"messages": [{"role": "user", "content": ""}] * 4}, 4 * MESSAGE_OVERHEAD, False),
        (CHAT, {"messages": [{"role": "user", "content": ""}] * 5}, 4 * MESSAGE_OVERHEAD, True),
    ],
)
def test_a_prompt_over_the_bound_is_refused(
    endpoint: str, body: dict[str, Any], limit: int, refused: bool
) -> None:
    got = prompt_of(endpoint, body, max_chars=limit)
    assert (got == Refused("too_long")) is refused
    assert not isinstance(got, Refused) or refused


@pytest.mark.parametrize(
    ("keep", "ids", "want"),
    [
        (None, [1, 2, 3], [1, 2, 3]),
        (2, [1, 2, 3], [2, 3]),
        (3, [1, 2, 3], [1, 2, 3]),
        (9, [1, 2, 3], [1, 2, 3]),
    ],
)
def test_truncate_prompt_tokens_keeps_the_last_ids(keep: int | None, ids: list[int], want: list[int]) -> None:
    body = {"prompt": ids, "truncate_prompt_tokens": keep}
    assert isinstance(prompt_of(COMPLETIONS, body), Ids)
    assert kept(ids, body) == want


@pytest.mark.parametrize("keep", [-1, 0, True, 2.0, "2"])
def test_a_truncation_the_proxy_cannot_mimic_is_refused(keep: object) -> None:
    assert prompt_of(COMPLETIONS, {"prompt": "x", "truncate_prompt_tokens": keep}) == Refused("truncate")
    assert prompt_of(CHAT, {"messages": [USER], "truncate_prompt_tokens": keep}) == Refused("truncate")
