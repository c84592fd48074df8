"""Where the committed real-vLLM captures live (one home for the tests and benchmarks).

Everything the tests read is inside the repository: a clone with nothing beside it runs
the whole suite (``.ci/run`` checks that by running from such a clone).
"""

from __future__ import annotations

from pathlib import Path

FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"
# Two whole /metrics pages (prefill and decode) of a CPU vLLM 0.32 pair after traffic.
SCRAPE_PAGES = FIXTURES_DIR / "vllm-0.32-cpu"
# The scripted captures of tests/real_vllm/capture_fixtures.py (vLLM 0.32.0).
REAL_CAPTURES = FIXTURES_DIR / "vllm-0.32.0-cpu"
