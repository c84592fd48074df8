"""The general exposition parser: real captures and every kind of bad input."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from collector.parse import Family, Sample, parse_float, parse_text
from tests.captures import SCRAPE_PAGES

FIXTURES = SCRAPE_PAGES
CAPTURES = sorted(FIXTURES.glob("*.txt"))


@pytest.fixture(params=[p.name for p in CAPTURES])
def capture(request: pytest.FixtureRequest) -> str:
    return (FIXTURES / request.param).read_text()


def test_real_capture_parses_without_errors(capture: str) -> None:
    page = parse_text(capture)
    assert page.errors == []
    assert page.families["vllm:request_success_total"].type == "counter"
    assert page.families["vllm:request_success_created"].type == "gauge"
    assert page.families["vllm:nixl_xfer_time_seconds"].type == "histogram"
    assert page.families["vllm:kv_cache_usage_perc"].type == "gauge"


def test_real_capture_agrees_with_prometheus_client(capture: str) -> None:
    """Every sample prometheus_client finds, we find with the same labels and value."""
    ours = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in parse_text(capture).families.values()
        for s in fam.samples
    }
    theirs = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(capture)
        for s in fam.samples
    }
    assert ours == theirs
    assert len(ours) > 400


def test_decode_capture_values() -> None:
    page = parse_text((FIXTURES / "decode_metrics.txt").read_bytes())
    succ = {s.labels["finished_reason"]: s.value for s in page.families["vllm:request_success_total"].samples}
    assert succ["length"] == 23.0
    xfer = page.families["vllm:nixl_xfer_time_seconds"]
    count = [s for s in xfer.samples if s.name.endswith("_count")]
    assert count == [Sample("vllm:nixl_xfer_time_seconds_count", {"engine": "0", "model_name": "tiny"}, 23.0)]
    inf_bucket = [s for s in xfer.samples if s.labels.get("le") == "+Inf"]
    assert inf_bucket[0].value == 23.0
    assert isinstance(xfer, Family)


def test_label_escapes_and_trailing_comma() -> None:
    text = 'm{a="x\\"y",b="back\\\\slash",c="new\\nline",d="}{,=",} 1\n'
    (sample,) = parse_text(text).families["m"].samples
    assert sample.labels == {"a": 'x"y', "b": "back\\slash", "c": "new\nline", "d": "}{,="}


def test_nan_inf_and_timestamps() -> None:
    text = "a NaN\nb +Inf\nc -Inf\nd 1.5e3 1700000000000\ne Inf\n"
    fams = parse_text(text).families
    assert math.isnan(fams["a"].samples[0].value)
    assert fams["b"].samples[0].value == math.inf
    assert fams["c"].samples[0].value == -math.inf
    assert fams["d"].samples[0].value == 1500.0
    assert fams["e"].samples[0].value == math.inf


@pytest.mark.parametrize(
    "line",
    [
        "no_value",
        'bad{a="1"',
        "bad{a=1} 2",
        'bad{a="1" b="2"} 3',
        'bad{a="1",a="2"} 3',
        "bad 1 2 3",
        "bad one",
        "1bad 2",
        "bad 1_000",
        'bad{="x"} 1',
    ],
)
def test_malformed_lines_are_reported_not_raised(line: str) -> None:
    page = parse_text(f"good 1\n{line}\nalso_good 2\n")
    assert set(page.families) == {"good", "also_good"}
    assert len(page.errors) == 1
    assert page.errors[0].startswith("line 2:")


def test_duplicate_series_keeps_first_and_reports() -> None:
    page = parse_text('# TYPE m gauge\nm{a="1"} 1\nm{a="1"} 2\nm{a="2"} 3\n')
    assert [s.value for s in page.families["m"].samples] == [1.0, 3.0]
    assert len(page.errors) == 1 and "duplicate" in page.errors[0]


def test_non_utf8_bytes_are_replaced_and_reported() -> None:
    page = parse_text(b'# HELP m caf\xe9\n# TYPE m gauge\nm{a="\xff"} 1\n')
    assert page.families["m"].samples[0].labels["a"] == "\ufffd"
    assert any("UTF-8" in e for e in page.errors)


def test_missing_help_and_type_is_untyped() -> None:
    page = parse_text("x 1\n# TYPE y counter\ny_total 2\n")
    assert page.families["x"].type == "untyped"
    assert page.families["x"].help == ""
    assert page.families["y"].samples[0].name == "y_total"


def test_multiprocess_help_text() -> None:
    text = (
        "# HELP vllm:request_success_total Multiprocess metric\n"
        "# TYPE vllm:request_success_total counter\n"
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 4.0\n'
    )
    fam = parse_text(text).families["vllm:request_success_total"]
    assert fam.help == "Multiprocess metric"
    assert fam.samples[0].value == 4.0


def test_openmetrics_counter_and_exemplar_and_eof() -> None:
    text = (
        "# TYPE vllm:prompt_tokens counter\n"
        "# UNIT vllm:prompt_tokens tokens\n"
        '# HELP vllm:prompt_tokens Number of \\"prefill\\" tokens.\\nMore.\n'
        'vllm:prompt_tokens_total{engine="0"} 7 # {trace_id="abc"} 1.0 1.7e9\n'
        'vllm:prompt_tokens_created{engine="0"} 1.7e9\n'
        "# EOF\n"
    )
    page = parse_text(text)
    fam = page.families["vllm:prompt_tokens"]
    assert page.errors == []
    assert [s.name for s in fam.samples] == ["vllm:prompt_tokens_total", "vllm:prompt_tokens_created"]
    assert fam.help == 'Number of \\"prefill\\" tokens.\nMore.'


def test_split_family_and_late_type() -> None:
    text = '# TYPE a gauge\na 1\n# TYPE b gauge\nb 2\na{x="1"} 3\n# TYPE a counter\n'
    page = parse_text(text)
    assert [s.value for s in page.families["a"].samples] == [1.0, 3.0]
    assert page.families["a"].type == "gauge"
    assert len(page.errors) == 1 and "TYPE" in page.errors[0]


def test_unknown_type_and_histogram_suffixes() -> None:
    text = (
        "# TYPE h histogram\n"
        'h_bucket{le="1.0"} 1\nh_bucket{le="+Inf"} 2\nh_count 2\nh_sum 3.5\n'
        "# TYPE w wibble\nw 1\n"
        "h_total 9\n"
    )
    page = parse_text(text)
    assert [s.name for s in page.families["h"].samples] == ["h_bucket", "h_bucket", "h_count", "h_sum"]
    assert page.families["w"].type == "untyped"
    assert "h_total" in page.families  # not a histogram suffix: a family of its own
    assert len(page.errors) == 1


def test_garbage_and_huge_inputs_do_not_raise() -> None:
    assert parse_text(b"").families == {}
    page = parse_text(bytes(range(256)) * 100)
    assert page.errors
    long_line = "m{" + 'a="b",' * 50_000 + " 1\n"
    page = parse_text(long_line)
    assert page.errors and not page.families
    many = "".join(f"bad line {i}\n" for i in range(1000))
    page = parse_text(many)
    assert len(page.errors) <= 101
    assert page.errors[-1].startswith("... and")


def test_parse_float() -> None:
    assert parse_float("2.097152e+06") == 2097152.0
    with pytest.raises(ValueError):
        parse_float("1_0")
    with pytest.raises(ValueError):
        parse_float("x")


@given(
    values=st.lists(st.text(min_size=0, max_size=20), min_size=1, max_size=5, unique=True),
    number=st.floats(allow_nan=False, allow_infinity=True, width=64),
)
@settings(max_examples=60, deadline=None)
def test_round_trip_through_prometheus_client_exposition(values: list[str], number: float) -> None:
    """Whatever label values prometheus_client writes (escapes included), we read back."""
    registry = CollectorRegistry()
    gauge = Gauge("pdscope_rt", "round trip", ["v"], registry=registry)
    for i, v in enumerate(values):
        gauge.labels(v).set(number if i == 0 else float(i))
    page = parse_text(generate_latest(registry))
    assert page.errors == []
    got = {s.labels["v"]: s.value for s in page.families["pdscope_rt"].samples}
    assert set(got) == set(values)
    assert got[values[0]] == number
