"""Signal extraction: the hot path must agree with the reference path on every variant."""

from __future__ import annotations

import json
import math
import re

import pytest

from collector.fastparse import extract_signals
from collector.signals import Signals, from_text
from pdscope.kvcompat import MALFORMED, MAX_CHARS
from tests.captures import SCRAPE_PAGES

FIXTURES = SCRAPE_PAGES
DECODE = (FIXTURES / "decode_metrics.txt").read_text()
PREFILL = (FIXTURES / "prefill_metrics.txt").read_text()


def _same(a: Signals, b: Signals) -> None:
    assert a.values == b.values
    assert a.histograms == b.histograms
    assert a.extra == b.extra
    assert a.engines == b.engines
    assert a.process_start_ts == b.process_start_ts
    assert a.identity == b.identity


def _two_engines(text: str) -> str:
    """Duplicate every engine="0" sample as engine="1" (data parallel), values doubled for engine 1."""
    out = []
    for line in text.splitlines():
        out.append(line)
        if 'engine="0"' in line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            out.append(name_labels.replace('engine="0"', 'engine="1"') + " " + repr(float(value) * 2))
    return "\n".join(out) + "\n"


def _multiprocess(text: str) -> str:
    """What --api-server-count > 1 gives: HELP 'Multiprocess metric', no _created, no process_*."""
    out, skip = [], False
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split()[2]
            skip = name.endswith("_created") or name.startswith(("process_", "python_"))
            if not skip:
                out.append(f"# HELP {name} Multiprocess metric")
            continue
        if line.startswith("# TYPE "):
            name = line.split()[2]
            skip = name.endswith("_created") or name.startswith(("process_", "python_"))
        if not skip:
            out.append(line)
    return "\n".join(out) + "\n"


def _openmetrics(text: str) -> str:
    """OpenMetrics naming: counters declared without _total; _created inside the family."""
    text = re.sub(r"^# (TYPE|HELP) (\S+)_total ", r"# \1 \2 ", text, flags=re.M)
    return text + "# EOF\n"


@pytest.mark.parametrize("page", [DECODE, PREFILL], ids=["decode", "prefill"])
def test_fast_path_equals_reference_on_real_captures(page: str) -> None:
    fast = extract_signals(page.encode())
    _same(fast, from_text(page))
    assert fast.errors == []
    json.dumps(fast.histograms, allow_nan=False)  # the store's JSON refuses NaN/Infinity


def test_decode_capture_values() -> None:
    s = extract_signals(DECODE)
    assert s.values["nixl_xfer_time_count"] == 23.0
    assert s.values["requests_length"] == 23.0
    assert s.values["prompt_tokens_external_kv_transfer"] == 1853.0
    assert s.values["itl_count"] == 277.0
    assert s.engines == 1
    assert s.process_start_ts == pytest.approx(1.79594402402e9)
    xfer = s.histograms["vllm:nixl_xfer_time_seconds"]
    assert xfer["le"][0] == 0.005 and len(xfer["counts"]) == len(xfer["le"]) + 1
    assert xfer["counts"][-1] == 23.0 and xfer["count"] == 23.0
    assert xfer["sum"] == pytest.approx(0.11799)


def test_prefill_capture_has_no_transfers() -> None:
    s = extract_signals(PREFILL)
    assert s.values["nixl_xfer_time_count"] == 0.0
    assert s.values["requests_length"] == 1.0


def test_engines_are_summed_and_kv_usage_averaged() -> None:
    page = _two_engines(
        DECODE.replace(
            'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.2',
        )
    )
    fast = extract_signals(page)
    _same(fast, from_text(page))
    assert fast.engines == 2
    assert fast.values["nixl_xfer_time_count"] == 23.0 * 3
    assert fast.values["requests_length"] == 23.0 * 3
    assert fast.values["kv_cache_usage"] == pytest.approx((0.2 + 0.4) / 2)
    assert fast.histograms["vllm:nixl_xfer_time_seconds"]["counts"][-1] == 69.0


def test_multiprocess_page() -> None:
    page = _multiprocess(DECODE)
    assert "Multiprocess metric" in page and "_created" not in page
    fast = extract_signals(page)
    _same(fast, from_text(page))
    ref = extract_signals(DECODE)
    assert fast.values == ref.values
    assert fast.process_start_ts is None


def test_openmetrics_page() -> None:
    page = _openmetrics(DECODE)
    fast = extract_signals(page)
    _same(fast, from_text(page))
    assert fast.values == extract_signals(DECODE).values


def test_older_vllm_names_and_missing_metrics() -> None:
    page = (
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
    )
    fast = extract_signals(page)
    _same(fast, from_text(page))
    assert fast.values == {"kv_cache_usage": 0.5, "num_running": 3.0}
    # the current name wins over the old one when both are present
    both = (
        page
        + '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
    )
    assert extract_signals(both).values["kv_cache_usage"] == 0.25
    assert from_text(both).values["kv_cache_usage"] == 0.25


def test_unknown_nixl_series_go_to_extra() -> None:
    page = DECODE + (
        "# TYPE vllm:nixl_num_new_thing_total counter\n"
        'vllm:nixl_num_new_thing_total{engine="0",model_name="tiny"} 7.0\n'
        "# TYPE vllm:nixl_new_thing_created gauge\n"
        'vllm:nixl_new_thing_created{engine="0",model_name="tiny"} 1.7e9\n'
    )
    fast = extract_signals(page)
    _same(fast, from_text(page))
    assert fast.extra == {"vllm:nixl_num_new_thing_total": 7.0}


def test_non_finite_values_are_not_stored() -> None:
    page = DECODE.replace(
        'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0',
        'vllm:num_requests_running{engine="0",model_name="tiny"} NaN',
    ).replace(
        'vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="tiny"} 0.11799',
        'vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="tiny"} +Inf',
    )
    fast = extract_signals(page)
    _same(fast, from_text(page))
    assert "num_running" not in fast.values
    assert "vllm:nixl_xfer_time_seconds" not in fast.histograms
    assert len(fast.errors) == 2
    json.dumps(fast.histograms, allow_nan=False)
    assert all(math.isfinite(v) for v in fast.values.values())


def test_malformed_line_in_a_kept_family_skips_only_that_family() -> None:
    page = DECODE.replace(
        'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0',
        'vllm:num_requests_running{engine="0",model_name="tiny"} zero',
    )
    fast = extract_signals(page)
    assert "num_running" not in fast.values
    assert fast.values["nixl_xfer_time_count"] == 23.0
    assert fast.errors and "num_requests_running" in fast.errors[0]
    ref = from_text(page)
    assert "num_running" not in ref.values and ref.errors


def test_pages_without_type_lines_use_the_general_parser() -> None:
    page = "\n".join(line for line in DECODE.splitlines() if not line.startswith("#"))
    fast = extract_signals(page)
    assert fast.values["requests_length"] == 23.0
    assert fast.values["num_running"] == 0.0


def test_garbage_and_non_utf8_never_raise() -> None:
    s = extract_signals(bytes(range(256)) * 50)
    assert not s.values
    s = extract_signals(DECODE.encode().replace(b'model_name="tiny"', b'model_name="t\xffny"'))
    assert s.values["requests_length"] == 23.0
    assert any("UTF-8" in e for e in s.errors)


def test_identity_is_the_model_block_size_and_kv_dtype_the_page_reports() -> None:
    fast = extract_signals(DECODE)
    assert fast.identity == (("block_size", "128"), ("cache_dtype", "auto"), ("model", "tiny"))
    no_info = re.sub(r"^vllm:cache_config_info\{.*\n", "", DECODE, flags=re.M)
    assert extract_signals(no_info).identity == (("model", "tiny"),)  # an older vLLM: only the model
    _same(extract_signals(no_info), from_text(no_info))


def test_identity_marks_engines_that_disagree_and_cuts_long_values() -> None:
    page = _two_engines(DECODE)
    assert dict(extract_signals(page).identity)["block_size"] == "128"  # both engines agree
    info = next(line for line in page.splitlines() if line.startswith("vllm:cache_config_info{"))
    other = info.replace('block_size="128"', 'block_size="64"').replace('engine="0"', 'engine="1"')
    split = page.replace(info, f"{info}\n{other}")
    fast = extract_signals(split)
    _same(fast, from_text(split))
    assert dict(fast.identity)["block_size"] == MALFORMED
    long = DECODE.replace('cache_dtype="auto"', f'cache_dtype="{"x" * 5000}"')
    assert len(dict(extract_signals(long).identity)["cache_dtype"]) == MAX_CHARS + 1
    escaped = DECODE.replace('model_name="tiny"', 'model_name="a\\"b"')
    assert dict(extract_signals(escaped).identity)["model"] == 'a"b'
    _same(extract_signals(escaped), from_text(escaped))
