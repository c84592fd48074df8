"""A real headless Chromium loads every page of a running ``pdscope dashboard`` (seeded
store, free port) and checks each screenshot is not blank and shows no Streamlit error.

With PDSCOPE_SAVE_SCREENSHOTS=1 the screenshots are written to docs/screenshots/.
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image, ImageStat

from .browser import Browser, running_dashboard
from .conftest import Seeded

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
PAGES = {
    "fleet": "Fleet",
    "why": "Why we missed",
    "requests": "Requests",
    "kv": "KV transfer",
    "prefix": "Prefix cache",
    "slos": "SLOs & alerts",
    "controller": "Controller",
    "capacity": "Capacity",
    "tenants": "Tenants",
}
# what a page must say once drawn (its text as the browser renders it)
CONTENT = {
    "why": ["Top reasons we missed", "of the excess since", "By instance, P×D pair and cause"],
    "slos": ["Why we missed: TTFTSLOBurn's window"],
    "controller": ["Decision regret", "flapping rate"],
    "tenants": ["Shares and SLOs", "Per tenant", "Jain's index"],
}


@pytest.fixture(scope="module")
def dashboard(seeded: Seeded, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``pdscope dashboard`` on a free port against the seeded store; yields its base URL."""
    with running_dashboard(seeded.config, tmp_path_factory.mktemp("dash") / "dashboard.log") as base:
        yield base


def _not_blank(png: bytes) -> tuple[float, float]:
    """(grey-level standard deviation, share of pixels that are not the page background)."""
    img = Image.open(io.BytesIO(png)).convert("L")
    std = ImageStat.Stat(img).stddev[0]
    hist = img.histogram()
    background = max(hist)
    return std, 1.0 - background / sum(hist)


@pytest.mark.parametrize("path", list(PAGES))
def test_page_renders_in_chromium(
    path: str, dashboard: str, browser: Browser, seeded: Seeded, tmp_path: Path
) -> None:
    # live=0: no fragment reruns, so "the script finished" is a stable state to wait for.
    url = f"{dashboard}/{'' if path == 'fleet' else path}?range=1h&live=0"
    if path == "requests":  # open the slowest request (on the degraded decode instance)
        url += f"&request={seeded.summary.slow_request_id}"
    shot = browser.shoot(url, timeout_s=180)
    probe = shot.probe
    name = {"kv": "kv_transfer", "prefix": "prefix_cache", "why": "why_we_missed"}.get(path, path)
    out = tmp_path / f"{name}.png"
    out.write_bytes(shot.png)
    if os.environ.get("PDSCOPE_SAVE_SCREENSHOTS") == "1":
        dest = REPO / "docs" / "screenshots"
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out, dest / f"{name}.png")
    assert probe["state"] == "notRunning", probe
    assert probe["title"] == PAGES[path], probe
    assert probe["exceptions"] == 0, probe["text"]
    bad = [e for e in probe["errors"] if "Traceback" in e or "cannot load" in e or "Error:" in e]
    assert not bad, bad
    std, ink = _not_blank(shot.png)
    assert std > 8.0 and ink > 0.03, (std, ink, out)
    assert probe["charts"] >= (0 if path == "controller" else 1), probe
    for words in CONTENT.get(path, []):
        assert words in probe["text"], (words, probe["text"])


def test_an_alerts_link_opens_why_we_missed_on_its_window(
    dashboard: str, browser: Browser, seeded: Seeded
) -> None:
    # the URL the SLOs page's link for a firing alert points at (views/slos.py: why_link)
    lo = seeded.spec.end - 600.0
    shot = browser.shoot(f"{dashboard}/why?from={lo:.3f}&alert=TTFTSLOBurn&live=0", timeout_s=180)
    probe = shot.probe
    assert probe["title"] == "Why we missed" and probe["exceptions"] == 0, probe
    assert "Showing the window of alert TTFTSLOBurn" in probe["text"], probe["text"]
    assert "Top reasons we missed" in probe["text"] and probe["charts"] >= 2, probe
