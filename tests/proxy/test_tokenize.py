"""The model's tokenizer in the proxy: vLLM's completion and chat paths, refusals, load errors.

The fixture tokenizer (tests/fixtures/tokenizer/, built by make_tokenizer.py there) prepends
``<s>`` in its post-processor, and its chat template writes ``bos_token`` itself, so the two
paths differ exactly where vLLM's do.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import tokenizers

from pdscope import simtokenizer
from proxy.prompts import CHAT, COMPLETIONS
from proxy.tokenize import HfTokenizer, SimTokenizer, TokenizerError, load_tokenizer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizer"
RAW = tokenizers.Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))  # the library, not our loader
BOS = RAW.token_to_id("<s>")
IM_START = RAW.token_to_id("<|im_start|>")
IM_END = RAW.token_to_id("<|im_end|>")


def raw(text: str, special: bool) -> list[int]:
    return list(RAW.encode(text, add_special_tokens=special).ids)


@pytest.fixture(scope="module")
def tok() -> HfTokenizer:
    got = load_tokenizer(str(FIXTURE))
    assert isinstance(got, HfTokenizer)
    return got


def chat(*messages: tuple[str, Any], **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": c} for r, c in messages], **extra}


def copy_fixture(tmp_path: Path, *, config: bool = True) -> Path:
    shutil.copy(FIXTURE / "tokenizer.json", tmp_path / "tokenizer.json")
    if config:
        shutil.copy(FIXTURE / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    return tmp_path


def write_config(folder: Path, **changes: Any) -> None:
    config = json.loads((FIXTURE / "tokenizer_config.json").read_text())
    config.update(changes)
    for k in [k for k, v in config.items() if v is None]:
        del config[k]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


# -- vLLM's two paths -----------------------------------------------------------------------


def test_a_completion_is_encoded_with_the_special_tokens(tok: HfTokenizer) -> None:
    got = tok.ids(COMPLETIONS, {"prompt": "Hello world, the cache"})
    assert got == raw("Hello world, the cache", True)
    assert got is not None and got[0] == BOS and got.count(BOS) == 1
    assert tok.ids(COMPLETIONS, {"prompt": "Hello", "add_special_tokens": False}) == raw("Hello", False)


def test_a_chat_is_the_rendered_template_encoded_without_special_tokens(tok: HfTokenizer) -> None:
    got = tok.ids(CHAT, chat(("system", "Be brief."), ("user", "Hello")))
    text = (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    )
    assert got == raw(text, False)
    assert got is not None and got[:2] == [BOS, IM_START]  # one BOS: the template's
    assert got.count(IM_START) == 3 and got.count(IM_END) == 2  # each marker one special id


def test_the_body_can_turn_the_generation_prompt_and_special_tokens_around(tok: HfTokenizer) -> None:
    text = "<s><|im_start|>user\nHello<|im_end|>\n"
    assert tok.ids(CHAT, chat(("user", "Hello"), add_generation_prompt=False)) == raw(text, False)
    with_bos = tok.ids(CHAT, chat(("user", "Hello"), add_generation_prompt=False, add_special_tokens=True))
    assert with_bos == raw(text, True) and with_bos[:2] == [BOS, BOS]
    # not a boolean: vLLM's default stands
    assert tok.ids(CHAT, chat(("user", "Hello"), add_generation_prompt="no")) == tok.ids(
        CHAT, chat(("user", "Hello"))
    )


def test_a_resent_history_shares_its_token_prefix(tok: HfTokenizer) -> None:
    turn1 = [("system", "You are a helpful assistant."), ("user", "What is the capital of France?")]
    turn2 = [*turn1, ("assistant", "Paris."), ("user", "And of Spain?")]
    a = tok.ids(CHAT, chat(*turn1, add_generation_prompt=False))
    b = tok.ids(CHAT, chat(*turn2))
    assert a is not None and b is not None and len(b) > len(a)
    assert b[: len(a)] == a


def test_text_parts_are_joined_like_one_string_and_media_is_refused(tok: HfTokenizer) -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    assert tok.ids(CHAT, chat(("user", parts))) == tok.ids(CHAT, chat(("user", "Hello\nworld")))
    image = [{"type": "text", "text": "Hello"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    assert tok.ids(CHAT, chat(("user", image))) is None
    assert tok.refused["multimodal"] >= 1


def test_token_ids_are_used_as_they_are(tok: HfTokenizer) -> None:
    assert tok.ids(COMPLETIONS, {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert tok.ids(COMPLETIONS, {"prompt": [[5, 6, 7]]}) == [5, 6, 7]
    assert tok.ids(COMPLETIONS, {"prompt": [[5], [6]]}) is None  # a batch: no one prefix


def test_a_template_that_raises_is_a_refusal_not_an_error(tok: HfTokenizer) -> None:
    before = tok.refused["template"]
    assert tok.ids(CHAT, chat(("tool", "42"))) is None  # the fixture's template raises on this role
    assert tok.refused["template"] == before + 1


def test_a_prompt_over_the_bound_costs_nothing(tmp_path: Path) -> None:
    tok = load_tokenizer(str(FIXTURE), max_chars=50)
    assert tok.ids(COMPLETIONS, {"prompt": "x" * 50}) is not None
    assert tok.ids(COMPLETIONS, {"prompt": "x" * 51}) is None
    assert tok.refused == {"too_long": 1}
    # a short chat whose template output is over the bound is refused too, before encoding
    folder = copy_fixture(tmp_path)
    write_config(folder, chat_template="{% for i in range(100) %}padding {% endfor %}")
    tok = load_tokenizer(str(folder), max_chars=50)
    assert tok.ids(CHAT, chat(("user", "x"))) is None and tok.refused == {"too_long": 1}


def test_the_template_sees_tools_kwargs_and_hf_helpers(tmp_path: Path) -> None:
    folder = copy_fixture(tmp_path)
    template = (
        "{% generation %}{{ tools | tojson }}{% endgeneration %}|{{ mode }}|{{ messages | length }}"
        "|{{ strftime_now('%Y') | length }}|{{ eos_token }}"
    )
    write_config(folder, chat_template=template)
    tok = load_tokenizer(str(folder))
    assert isinstance(tok, HfTokenizer)
    body = chat(("user", "x"), tools=[{"name": "é"}], chat_template_kwargs={"mode": "fast", "messages": "no"})
    want = '[{"name": "é"}]|fast|1|4|</s>'
    assert tok.ids(CHAT, body) == raw(want, False)


def test_a_tokenizer_json_carrying_truncation_does_not_truncate_prompts(tmp_path: Path) -> None:
    spec = json.loads((FIXTURE / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    got = tok.ids(COMPLETIONS, {"prompt": "The quick brown fox jumps over the lazy dog"})
    assert got == raw("The quick brown fox jumps over the lazy dog", True) and len(got) > 4


# -- where the template comes from ------------------------------------------------------------


def test_the_path_of_a_tokenizer_json_reads_the_config_beside_it(tok: HfTokenizer) -> None:
    direct = load_tokenizer(str(FIXTURE / "tokenizer.json"))
    body = chat(("user", "Hello"))
    assert direct.ids(CHAT, body) == tok.ids(CHAT, body) is not None


def test_without_a_template_chats_are_refused_and_completions_still_work(tmp_path: Path) -> None:
    tok = load_tokenizer(str(copy_fixture(tmp_path, config=False)))
    assert tok.ids(CHAT, chat(("user", "Hello"))) is None
    assert tok.refused == {"no_template": 1}
    assert tok.ids(COMPLETIONS, {"prompt": "Hello"}) == raw("Hello", True)


def test_a_chat_template_jinja_file_and_a_named_template_list(tmp_path: Path) -> None:
    folder = copy_fixture(tmp_path)
    write_config(folder, chat_template=None)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert load_tokenizer(str(folder)).ids(CHAT, chat(("user", "a"))) == raw("[a]", False)
    write_config(
        folder, chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    )
    assert load_tokenizer(str(folder)).ids(CHAT, chat(("user", "a"))) == raw("D", False)


def test_special_tokens_written_as_dicts_or_strings() -> None:
    tok = load_tokenizer(str(FIXTURE))
    assert isinstance(tok, HfTokenizer)
    assert tok.specials["bos_token"] == "<s>"  # {"content": "<s>", ...} in the fixture
    assert tok.specials["eos_token"] == "</s>"  # a plain string there
    assert tok.specials["unk_token"] is None


def test_an_unset_special_token_renders_as_nothing_not_none(tmp_path: Path) -> None:
    folder = copy_fixture(tmp_path)
    write_config(folder, chat_template="[{{ unk_token }}]{{ bos_token }}")
    assert load_tokenizer(str(folder)).ids(CHAT, chat(("user", "x"))) == raw("[]<s>", False)


# -- load errors ----------------------------------------------------------------------------------


def broken(tmp_path: Path, name: str, text: str) -> Path:
    folder = copy_fixture(tmp_path)
    (folder / name).write_text(text)
    return folder


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda p: p / "missing", "no such file or directory"),
        (lambda p: p, "a directory without a tokenizer.json"),
        (lambda p: broken(p, "tokenizer.json", "{not json"), "not a tokenizer.json"),
        (lambda p: broken(p, "tokenizer.json", '{"model": {"type": "Nope"}}'), "not a tokenizer.json"),
        (lambda p: broken(p, "tokenizer_config.json", "{oops"), "cannot be read as JSON"),
        (lambda p: broken(p, "tokenizer_config.json", "[1, 2]"), "not an object"),
        (lambda p: broken(p, "tokenizer_config.json", '{"chat_template": 3}'), "chat_template is a int"),
        (lambda p: broken(p, "tokenizer_config.json", '{"chat_template": [{"name": "x"}]}'), "'default'"),
        (lambda p: broken(p, "tokenizer_config.json", '{"chat_template": "{% for %}"}'), "not a valid jinja"),
    ],
)
def test_a_path_that_is_not_a_tokenizer_names_itself_and_the_fault(
    tmp_path: Path, make: Any, says: str
) -> None:
    path = make(tmp_path)
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(str(path))
    assert says in str(err.value)
    assert str(tmp_path) in str(err.value)
    assert isinstance(err.value, ValueError)


# -- the simulator's -------------------------------------------------------------------------------


def test_pdscope_sim_is_the_simulators_tokenizer() -> None:
    tok = load_tokenizer(simtokenizer.NAME)
    assert isinstance(tok, SimTokenizer)
    assert tok.ids(COMPLETIONS, {"prompt": "a b c"}) == simtokenizer.text_ids("a b c")
    assert tok.ids(COMPLETIONS, {"prompt": [9, 8]}) == [9, 8]
    msgs = [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c"}]
    assert tok.ids(CHAT, {"messages": msgs}) == simtokenizer.chat_ids(msgs)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.ids(CHAT, {"messages": parts}) == simtokenizer.chat_ids(parts)
    assert tok.ids(COMPLETIONS, {"prompt": ["a", "b"]}) is None and tok.refused == {"batch": 1}


def test_block_tags_take_their_line_with_them_as_in_hf(tmp_path: Path) -> None:
    folder = copy_fixture(tmp_path)
    template = (
        "{% for m in messages %}\n"
        "    {% if m.role == 'user' %}\n"
        "{{ m.content }}\n"
        "    {% endif %}\n"
        "{% endfor %}"
    )
    write_config(folder, chat_template=template)
    assert load_tokenizer(str(folder)).ids(CHAT, chat(("user", "a"), ("user", "b"))) == raw("a\nb\n", False)


def test_truncate_prompt_tokens_keeps_the_tail_of_either_path(tok: HfTokenizer) -> None:
    full = tok.ids(COMPLETIONS, {"prompt": "The quick brown fox"})
    assert full is not None and len(full) > 3
    assert tok.ids(COMPLETIONS, {"prompt": "The quick brown fox", "truncate_prompt_tokens": 3}) == full[-3:]
    whole = tok.ids(CHAT, chat(("user", "Hello")))
    assert whole is not None
    assert tok.ids(CHAT, chat(("user", "Hello"), truncate_prompt_tokens=2)) == whole[-2:]
    sim = load_tokenizer(simtokenizer.NAME)
    assert sim.ids(COMPLETIONS, {"prompt": "a b c", "truncate_prompt_tokens": 1}) == simtokenizer.text_ids(
        "c"
    )


def test_the_committed_fixture_is_what_its_script_builds(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_tokenizer", FIXTURE / "make_tokenizer.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.build(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (FIXTURE / name).read_bytes(), name
