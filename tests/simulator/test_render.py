"""vLLM's render endpoints on a simulated instance: the shape real vLLM answers (a list of
GenerateRequests for completions, one for chat), the token ids the instance itself caches, and bad
input refused with a 400 naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdscope import simtokenizer
from simulator.render import SAMPLING_DEFAULTS, RenderError, render, sampling_params
from simulator.server import prompt_ids_of
from simulator.testing import RunningFleet, running_fleet

BS = 16
# vllm/entrypoints/serve/disagg/protocol.py: GenerateRequest's fields
GENERATE_REQUEST_KEYS = {
    "request_id",
    "token_ids",
    "features",
    "sampling_params",
    "model",
    "stream",
    "stream_options",
    "cache_salt",
    "priority",
    "kv_transfer_params",
}
# what vllm-router 0.1.17 (--policy kv_aware) sent to a worker's render endpoints, captured
ROUTER_COMPLETION_BODY = {
    "prompt": "hello world foo",
    "max_tokens": 3,
    "stream": False,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}
ROUTER_CHAT_BODY = {
    "messages": [{"role": "user", "content": "hello"}],
    "stream": False,
    "max_tokens": 3,
    "logprobs": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}
MAX_MODEL_LEN = 4096


@pytest.fixture(scope="module")
def fleet() -> Iterator[RunningFleet]:
    with running_fleet(
        1, 1, seed=5, latency_scale=0.0, block_size=BS, prefix_caching=True, max_model_len=MAX_MODEL_LEN
    ) as f:
        yield f


@pytest.fixture()
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10) as c:
        yield c


def p_name(fleet: RunningFleet) -> str:
    return next(name for role, name, _ in fleet.instances if role == "prefill")


def post(client: httpx.Client, fleet: RunningFleet, path: str, body: Any) -> httpx.Response:
    return client.post(fleet.prefill_urls[0] + path, json=body)


def test_completion_render_is_a_list_of_generate_requests(fleet: RunningFleet, client: httpx.Client) -> None:
    r = post(client, fleet, "/v1/completions/render", {"model": fleet.model_name, **ROUTER_COMPLETION_BODY})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    got = r.json()
    assert isinstance(got, list) and len(got) == 1
    g = got[0]
    assert set(g) == GENERATE_REQUEST_KEYS
    assert g["request_id"].startswith("cmpl-") and len(g["request_id"]) > len("cmpl-")
    assert g["token_ids"] == simtokenizer.text_ids("hello world foo")
    assert g["model"] == fleet.model_name
    assert g["sampling_params"]["max_tokens"] == 3
    assert g["sampling_params"]["skip_special_tokens"] is True
    assert (g["stream"], g["stream_options"], g["features"], g["kv_transfer_params"]) == (
        False,
        None,
        None,
        None,
    )
    assert (g["priority"], g["cache_salt"]) == (0, None)


def test_chat_render_is_one_generate_request(fleet: RunningFleet, client: httpx.Client) -> None:
    r = post(client, fleet, "/v1/chat/completions/render", {"model": fleet.model_name, **ROUTER_CHAT_BODY})
    assert r.status_code == 200, r.text
    g = r.json()
    assert isinstance(g, dict) and set(g) == GENERATE_REQUEST_KEYS
    assert g["request_id"].startswith("chatcmpl-")
    assert g["token_ids"] == simtokenizer.chat_ids(ROUTER_CHAT_BODY["messages"])


def test_the_model_may_be_left_out_and_request_ids_differ(fleet: RunningFleet, client: httpx.Client) -> None:
    a = post(client, fleet, "/v1/completions/render", {"prompt": "a b c"}).json()[0]
    b = post(client, fleet, "/v1/completions/render", {"prompt": "a b c"}).json()[0]
    assert a["model"] == fleet.model_name
    assert a["request_id"] != b["request_id"]
    assert a["token_ids"] == b["token_ids"]


def test_rendered_ids_are_the_ids_the_instance_caches(fleet: RunningFleet, client: httpx.Client) -> None:
    """A router that keys its view with the rendered ids finds what the instance holds after serving."""
    messages = [
        {"role": "system", "content": " ".join(f"sys{i}" for i in range(60))},
        {"role": "user", "content": "what is the question"},
    ]
    ids = post(client, fleet, "/v1/chat/completions/render", {"messages": messages}).json()["token_ids"]
    assert fleet.cached_tokens(ids)[p_name(fleet)] == 0
    r = post(client, fleet, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    assert fleet.cached_tokens(ids)[p_name(fleet)] == len(ids) // BS * BS


def test_a_batch_of_prompts_renders_one_request_each(fleet: RunningFleet, client: httpx.Client) -> None:
    got = post(client, fleet, "/v1/completions/render", {"prompt": ["one two", [7, 8, 9]]}).json()
    assert [g["token_ids"] for g in got] == [simtokenizer.text_ids("one two"), [7, 8, 9]]
    assert len({g["request_id"] for g in got}) == 2


def test_streaming_keeps_its_options(fleet: RunningFleet, client: httpx.Client) -> None:
    opts = {"include_usage": True}
    g = post(client, fleet, "/v1/completions/render", {"prompt": "x", "stream": True, "stream_options": opts})
    assert (g.json()[0]["stream"], g.json()[0]["stream_options"]) == (True, opts)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions/render", {"prompt": 5}, "prompt"),
        ("/v1/completions/render", {"prompt": [1, -2]}, "prompt"),
        ("/v1/completions/render", {}, "prompt"),
        ("/v1/chat/completions/render", {"messages": []}, "messages"),
        ("/v1/chat/completions/render", {"prompt": "hi"}, "messages"),
        ("/v1/completions/render", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions/render", {"prompt": "x", "max_tokens": "3"}, "max_tokens"),
        ("/v1/completions/render", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions/render", {"prompt": "x", "stop": [1]}, "stop"),
        ("/v1/completions/render", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions/render", {"prompt": "x", "priority": 1.5}, "priority"),
        ("/v1/completions/render", {"prompt": "x", "stream": "yes"}, "stream"),
        (
            "/v1/chat/completions/render",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": 2},
            "logprobs",
        ),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    fleet: RunningFleet, client: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    r = post(client, fleet, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, 400, "BadRequestError")


def test_an_unknown_model_is_a_404(fleet: RunningFleet, client: httpx.Client) -> None:
    r = post(client, fleet, "/v1/completions/render", {"model": "other", "prompt": "x"})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model"


def test_a_body_that_is_not_json_or_not_an_object_is_a_400(fleet: RunningFleet, client: httpx.Client) -> None:
    url = fleet.prefill_urls[0] + "/v1/completions/render"
    assert client.post(url, content=b"{not json").status_code == 400
    assert client.post(url, json=[1, 2]).status_code == 400


def test_a_prompt_over_the_context_is_refused(fleet: RunningFleet, client: httpx.Client) -> None:
    long_prompt = " ".join(["w"] * (MAX_MODEL_LEN + 1))
    r = post(client, fleet, "/v1/completions/render", {"prompt": long_prompt})
    assert (
        r.status_code == 400 and r.json()["error"]["param"] == "input_tokens"
    )  # vLLM 0.32 names the prompt: input_tokens


# -- the pure function ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "want"),
    [
        ({}, {"max_tokens": MAX_MODEL_LEN - 2}),  # the room the prompt leaves, as vLLM's get_max_tokens
        (
            {"max_tokens": 5, "temperature": 0, "top_k": 4, "seed": 9},
            {"max_tokens": 5, "temperature": 0.0, "top_k": 4, "seed": 9},
        ),
        ({"stop": "END"}, {"stop": ["END"]}),
        ({"stop_token_ids": [2, 3], "ignore_eos": True}, {"stop_token_ids": [2, 3], "ignore_eos": True}),
        ({"logprobs": 3}, {"logprobs": 3}),
    ],
)
def test_completion_sampling_params(body: dict[str, Any], want: dict[str, Any]) -> None:
    got = render({"prompt": "a b", **body}, False, "m", MAX_MODEL_LEN, prompt_ids_of)
    assert isinstance(got, list)
    sp = got[0]["sampling_params"]
    assert set(sp) == {*SAMPLING_DEFAULTS, "max_tokens"}
    for k, v in {**SAMPLING_DEFAULTS, **want}.items():
        if k != "max_tokens" or "max_tokens" in want:
            assert sp[k] == v, k


@pytest.mark.parametrize(
    ("body", "logprobs", "max_tokens"),
    [
        ({"logprobs": True, "top_logprobs": 4}, 4, MAX_MODEL_LEN - 5),
        ({"logprobs": True}, 0, MAX_MODEL_LEN - 5),
        ({"logprobs": False, "top_logprobs": 4}, None, MAX_MODEL_LEN - 5),
        ({"max_completion_tokens": 7, "max_tokens": 9}, None, 7),
    ],
)
def test_chat_sampling_params(body: dict[str, Any], logprobs: int | None, max_tokens: int) -> None:
    msgs = [{"role": "user", "content": "x"}]  # 5 tokens under the simulated template
    got = render({"messages": msgs, **body}, True, "m", MAX_MODEL_LEN, prompt_ids_of, lambda: "fixed")
    assert isinstance(got, dict)
    assert got["request_id"] == "chatcmpl-fixed"
    assert (got["sampling_params"]["logprobs"], got["sampling_params"]["max_tokens"]) == (
        logprobs,
        max_tokens,
    )


def test_beam_search_is_refused() -> None:
    with pytest.raises(RenderError) as exc:
        render({"prompt": "x", "use_beam_search": True}, False, "m", MAX_MODEL_LEN, prompt_ids_of)
    assert exc.value.param == "use_beam_search"


def test_sampling_params_refuse_a_negative_logprobs() -> None:
    with pytest.raises(RenderError) as exc:
        sampling_params({"logprobs": -1}, 5, False)
    assert exc.value.param == "logprobs"


@pytest.mark.parametrize(
    ("prompt_words", "max_tokens", "want"),
    [
        # vLLM 0.32 (get_max_tokens): prompt + max_tokens past the context is cut to the room left
        (10, MAX_MODEL_LEN - 5, "clamped"),
        (10, 5, 5),
        # max_tokens alone past the context, or a prompt that fills it: 400 naming the field
        (10, MAX_MODEL_LEN + 1, "max_tokens"),
        (MAX_MODEL_LEN, 5, "input_tokens"),
    ],
)
def test_the_context_is_checked_as_vllm_does(prompt_words: int, max_tokens: int, want: int | str) -> None:
    body = {"prompt": " ".join(["w"] * prompt_words), "max_tokens": max_tokens}
    prompt_len = len(prompt_ids_of(body, False))
    if want in ("max_tokens", "input_tokens"):
        with pytest.raises(RenderError) as exc:
            render(body, False, "m", MAX_MODEL_LEN, prompt_ids_of)
        assert exc.value.param == want
        return
    got = render(body, False, "m", MAX_MODEL_LEN, prompt_ids_of)
    assert isinstance(got, list)
    expect = MAX_MODEL_LEN - prompt_len if want == "clamped" else want
    assert got[0]["sampling_params"]["max_tokens"] == expect
