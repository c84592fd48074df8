"""make_view: the view proxy.kv_aware.mode names, from plain settings."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from pdscope import simtokenizer
from proxy.approx import ApproxView
from proxy.kvindex import PrefixIndex
from proxy.precise import PreciseView
from proxy.tokenize import HfTokenizer, SimTokenizer, TokenizerError
from proxy.views import make_view

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizer"


def test_off_is_no_view() -> None:
    assert make_view("off", tokenizer=simtokenizer.NAME) is None


def test_approximate_takes_its_settings() -> None:
    v = make_view(
        "approximate",
        approx_block_chars=32,
        approx_chars_per_token=2.0,
        approx_ttl_s=9.0,
        approx_capacity_tokens=160,
        max_index_blocks=77,
        clock=lambda: 5.0,
    )
    assert isinstance(v, ApproxView)
    assert (v.block_chars, v.block_tokens, v.ttl_s, v.capacity_blocks, v.max_entries) == (32, 16, 9.0, 10, 77)
    assert v.clock() == 5.0


def test_precise_loads_the_tokenizer_and_reads_the_given_index() -> None:
    index, lock = PrefixIndex(16, 100), threading.Lock()
    v = make_view("precise", tokenizer=simtokenizer.NAME, base_model="m", index=index, lock=lock)
    assert isinstance(v, PreciseView) and isinstance(v.tokenizer, SimTokenizer)
    assert v.index is index and v.lock is lock and v.base_model == "m" and v.block_size == 16
    v = make_view("precise", tokenizer=str(FIXTURE), index=index, lock=lock, max_prompt_chars=10)
    assert isinstance(v, PreciseView) and isinstance(v.tokenizer, HfTokenizer)
    assert v.tokenizer.max_chars == 10


def test_precise_without_what_it_needs_is_refused(tmp_path: Path) -> None:
    index, lock = PrefixIndex(16, 100), threading.Lock()
    with pytest.raises(ValueError, match=r"model\.tokenizer is required"):
        make_view("precise", index=index, lock=lock)
    with pytest.raises(ValueError, match="index"):
        make_view("precise", tokenizer=simtokenizer.NAME)
    with pytest.raises(TokenizerError, match="no such file"):
        make_view("precise", tokenizer=str(tmp_path / "nope"), index=index, lock=lock)
    with pytest.raises(ValueError, match=r"proxy\.kv_aware\.mode"):
        make_view("sometimes", index=index, lock=lock)  # type: ignore[arg-type]
