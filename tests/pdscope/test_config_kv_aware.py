"""The KV-aware routing settings: model.tokenizer and proxy.kv_aware, defaults and refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdscope.config import ConfigError, parse_config
from tests.pdscope.test_config import MINIMAL

MODEL = "model: {name: tiny, kv_bytes_per_token: 1024}"


def _with_model(extra: str) -> str:
    return MINIMAL.replace(MODEL, "model: {name: tiny, kv_bytes_per_token: 1024" + extra + "}")


def test_defaults_are_off_and_documented_values() -> None:
    s = parse_config(MINIMAL)
    kv = s.proxy.kv_aware
    assert s.model.tokenizer is None
    assert kv.mode == "off"
    assert (kv.affinity_bound, kv.prefill_tokens_per_s, kv.transfer_tokens_per_s) == (1.5, 16000, 200000)
    assert (kv.max_index_blocks, kv.event_queue_max) == (1_000_000, 10000)
    assert (kv.approx_block_chars, kv.approx_chars_per_token, kv.approx_ttl_s) == (64, 4.0, 300)
    assert kv.approx_capacity_tokens == 500000
    assert (kv.decode_only.enabled, kv.decode_only.max_uncached_tokens) == (False, 256)
    assert kv.decode_only.min_d_cached_ratio == 0.9


def test_precise_with_the_simulated_tokenizer_and_with_a_path(tmp_path: Path) -> None:
    s = parse_config(_with_model(", tokenizer: pdscope-sim") + "proxy: {kv_aware: {mode: precise}}\n")
    assert (s.model.tokenizer, s.proxy.kv_aware.mode) == ("pdscope-sim", "precise")
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    for path in (tok, tmp_path):  # the file, or its directory
        s = parse_config(_with_model(f", tokenizer: '{path}'") + "proxy: {kv_aware: {mode: precise}}\n")
        assert s.model.tokenizer == str(path)


def test_approximate_needs_no_tokenizer() -> None:
    s = parse_config(MINIMAL + "proxy: {kv_aware: {mode: approximate, decode_only: {enabled: true}}}\n")
    assert s.proxy.kv_aware.mode == "approximate" and s.proxy.kv_aware.decode_only.enabled


@pytest.mark.parametrize(
    ("snippet", "field"),
    [
        (_with_model(", tokenizer: /no/such/tokenizer.json"), "model.tokenizer"),
        (_with_model(", tokenizer: ''"), "model.tokenizer"),
        (MINIMAL + "proxy: {kv_aware: {mode: precise}}\n", "proxy.kv_aware.mode"),
        (MINIMAL + "proxy: {kv_aware: {mode: exact}}\n", "proxy.kv_aware.mode"),
        (MINIMAL + "proxy: {kv_aware: {affinity_bound: 0.5}}\n", "proxy.kv_aware.affinity_bound"),
        (MINIMAL + "proxy: {kv_aware: {prefill_tokens_per_s: 0}}\n", "proxy.kv_aware.prefill_tokens_per_s"),
        (
            MINIMAL + "proxy: {kv_aware: {transfer_tokens_per_s: -1}}\n",
            "proxy.kv_aware.transfer_tokens_per_s",
        ),
        (MINIMAL + "proxy: {kv_aware: {max_index_blocks: 0}}\n", "proxy.kv_aware.max_index_blocks"),
        (MINIMAL + "proxy: {kv_aware: {approx_block_chars: 0}}\n", "proxy.kv_aware.approx_block_chars"),
        (
            MINIMAL + "proxy: {kv_aware: {approx_chars_per_token: 0}}\n",
            "proxy.kv_aware.approx_chars_per_token",
        ),
        (MINIMAL + "proxy: {kv_aware: {approx_ttl_s: .nan}}\n", "proxy.kv_aware.approx_ttl_s"),
        (
            MINIMAL + "proxy: {kv_aware: {approx_capacity_tokens: 0}}\n",
            "proxy.kv_aware.approx_capacity_tokens",
        ),
        (MINIMAL + "proxy: {kv_aware: {event_queue_max: 0}}\n", "proxy.kv_aware.event_queue_max"),
        (
            MINIMAL + "proxy: {kv_aware: {decode_only: {max_uncached_tokens: -1}}}\n",
            "proxy.kv_aware.decode_only.max_uncached_tokens",
        ),
        (
            MINIMAL + "proxy: {kv_aware: {decode_only: {min_d_cached_ratio: 1.5}}}\n",
            "proxy.kv_aware.decode_only.min_d_cached_ratio",
        ),
        (MINIMAL + "proxy: {kv_aware: {decode_only: {enable: true}}}\n", "proxy.kv_aware.decode_only.enable"),
    ],
)
def test_bad_values_name_the_field(snippet: str, field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(snippet, "f.yaml")
    assert any(f": {field}: " in line for line in exc.value.problems), exc.value.problems


def test_a_tokenizer_path_the_file_system_cannot_hold_is_a_config_error() -> None:
    # was: OSError (File name too long) out of config loading
    with pytest.raises(ConfigError, match="tokenizer"):
        parse_config(_with_model(", tokenizer: " + "x" * 300))
