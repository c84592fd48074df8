"""The simulator's /metrics against real vLLM captures, read with the collector's parser.

Every family of the real pages (vLLM's own, NIXL's, the HTTP instrumentator's) must be
on the simulator's page with the same type, HELP, label names and bucket bounds; the
request_tokens buckets depend on --max-model-len, so the simulator runs with a length
that gives the capture's bounds.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from collector.parse import Family, ParsedPage, parse_text
from simulator.metrics import build_1_2_5_buckets
from simulator.testing import RunningFleet, running_fleet
from tests.captures import REAL_CAPTURES, SCRAPE_PAGES

REPO = Path(__file__).resolve().parents[2]
CAPTURE_DIRS = [SCRAPE_PAGES, REAL_CAPTURES]
RUNTIME = ("python_", "process_")  # the process's own collectors: same names, values of this process


def captures() -> list[tuple[str, Path]]:
    out = []
    for d in CAPTURE_DIRS:
        for path in sorted(d.glob("*metrics*.txt")) if d.is_dir() else []:
            role = "prefill" if "prefill" in path.name else "decode" if "decode" in path.name else ""
            if role:
                out.append((role, path))
    return out


def label_names(fam: Family) -> set[frozenset[str]]:
    return {frozenset(k for k in s.labels if k not in ("le", "quantile")) for s in fam.samples}


def buckets(fam: Family) -> list[str]:
    seen: list[str] = []
    for s in fam.samples:
        le = s.labels.get("le")
        if le is not None and le not in seen:
            seen.append(le)
    return seen


@pytest.fixture(scope="module")
def pages() -> Iterator[dict[str, ParsedPage]]:
    """Sim pages after some P/D traffic of both endpoints (so the HTTP families have series)."""
    with (
        running_fleet(1, 1, seed=0, latency_scale=0.05, max_model_len=512, block_size=128) as fleet,
        httpx.Client(timeout=10) as client,
    ):
        _traffic(fleet, client)
        yield {
            "prefill": parse_text(client.get(fleet.prefill_urls[0] + "/metrics").content),
            "decode": parse_text(client.get(fleet.decode_urls[0] + "/metrics").content),
        }


def _traffic(fleet: RunningFleet, client: httpx.Client) -> None:
    for path, key, value in (
        ("/v1/completions", "prompt", "x " * 40),
        ("/v1/chat/completions", "messages", [{"role": "user", "content": "x " * 40}]),
    ):
        body = {
            "model": fleet.model_name,
            key: value,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        kv = client.post(fleet.prefill_urls[0] + path, json=body).json()["kv_transfer_params"]
        body.update(max_tokens=8, kv_transfer_params=kv)
        assert client.post(fleet.decode_urls[0] + path, json=body).status_code == 200


def test_there_are_real_captures_to_compare_with() -> None:
    roles = {role for role, _ in captures()}
    assert roles == {"prefill", "decode"}


@pytest.mark.parametrize(("role", "path"), captures(), ids=lambda v: str(v))
def test_every_real_family_is_on_the_sim_page_with_same_shape(
    pages: dict[str, ParsedPage], role: str, path: Path
) -> None:
    real = parse_text(path.read_bytes())
    sim = pages[role]
    problems = []
    vllm_families = [n for n in real.families if n.startswith("vllm:")]
    assert len(vllm_families) > 40
    for name, fam in real.families.items():
        if name.startswith(RUNTIME) or name == "vllm:cache_config_info":
            if name not in sim.families:
                problems.append(f"{name}: missing")
            continue
        mine = sim.families.get(name)
        if mine is None:
            problems.append(f"{name}: missing")
            continue
        if mine.type != fam.type:
            problems.append(f"{name}: type {mine.type} != {fam.type}")
        if mine.help != fam.help:
            problems.append(f"{name}: HELP {mine.help!r} != {fam.help!r}")
        if not fam.samples:  # e.g. the HTTP families before any request: nothing more to compare
            continue
        if label_names(mine) != label_names(fam):
            problems.append(f"{name}: labels {label_names(mine)} != {label_names(fam)}")
        if buckets(mine) != buckets(fam):
            problems.append(f"{name}: buckets {buckets(mine)} != {buckets(fam)}")
    assert not problems, "\n".join(problems)


def test_cache_config_info_has_vllms_label_names(pages: dict[str, ParsedPage]) -> None:
    for role, path in captures():
        real = parse_text(path.read_bytes()).families["vllm:cache_config_info"]
        mine = pages[role].families["vllm:cache_config_info"]
        assert label_names(mine) == label_names(real)
        assert mine.samples[0].labels["block_size"] == "128"


def test_series_identity_matches_real_page_exactly_for_vllm_families(pages: dict[str, ParsedPage]) -> None:
    """Same sample names and label sets (values aside), e.g. every finished_reason and stage."""
    for role, path in captures():
        real = parse_text(path.read_bytes())
        for name, fam in real.families.items():
            if not name.startswith("vllm:") or name == "vllm:cache_config_info":
                continue
            want = {(s.name, frozenset(s.labels.items() - {("model_name", "tiny")})) for s in fam.samples}
            got = {
                (s.name, frozenset(s.labels.items() - {("model_name", "sim-llama-70b")}))
                for s in pages[role].families[name].samples
            }
            assert got == want, name


def test_request_token_buckets_follow_max_model_len() -> None:
    assert build_1_2_5_buckets(512) == [1, 2, 5, 10, 20, 50, 100, 200, 500]
    assert build_1_2_5_buckets(32768)[-1] == 20000.0


def test_counters_only_grow_and_values_follow_events() -> None:
    with running_fleet(1, 1, seed=1, latency_scale=0.0) as fleet, httpx.Client(timeout=10) as client:
        snaps = []
        for _ in range(3):
            _traffic(fleet, client)
            snaps.append(
                {
                    url: parse_text(client.get(url + "/metrics").content)
                    for url in (fleet.prefill_urls[0], fleet.decode_urls[0])
                }
            )
        for url in snaps[0]:
            for a, b in itertools.pairwise(snaps):
                for name, fam in a[url].families.items():
                    if fam.type not in ("counter", "histogram") or name.startswith(RUNTIME):
                        continue
                    later = {
                        (s.name, tuple(sorted(s.labels.items()))): s.value
                        for s in b[url].families[name].samples
                    }
                    for s in fam.samples:
                        key = (s.name, tuple(sorted(s.labels.items())))
                        assert later[key] >= s.value, (url, key)
        d = snaps[-1][fleet.decode_urls[0]]
        p = snaps[-1][fleet.prefill_urls[0]]

        def value(page: ParsedPage, sample: str, **labels: str) -> float:
            for fam in page.families.values():
                for s in fam.samples:
                    if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                        return s.value
            raise KeyError(sample)

        assert value(d, "vllm:nixl_xfer_time_seconds_count") == 6
        assert value(p, "vllm:nixl_xfer_time_seconds_count") == 0
        assert value(p, "vllm:request_success_total", finished_reason="length") == 6
        assert value(d, "vllm:generation_tokens_total") == 6 * 8
        assert value(p, "vllm:generation_tokens_total") == 6
        assert value(d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0
        assert value(p, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
        assert value(d, "vllm:prompt_tokens_cached_by_source_total", source="p2p") > 0
        assert value(p, "vllm:request_time_per_output_token_seconds_sum") == 0  # one token on P
        assert value(d, "http_requests_total", handler="/v1/chat/completions", status="2xx") == 3
