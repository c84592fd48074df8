"""README.md and docs/*.md: every relative link resolves, and the README's example config is valid."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdscope.config import parse_config

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [REPO / "README.md", *DOCS]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text without code blocks and inline code (a link in code is an example, not a link)."""
    return _CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for h in _HEADING.findall(_FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(h)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    return [
        t
        for t in _LINK.findall(_prose(path.read_text(encoding="utf-8")))
        if not re.match(r"^[a-z][a-z0-9+.-]*:", t)
    ]  # http:, https:, mailto: are not checked here


def test_slug_matches_github() -> None:
    assert slug("Goodput under faults") == "goodput-under-faults"
    assert (
        slug("Proxy (`bench/proxy/run.py`, writes `bench/results/proxy.json`)")
        == "proxy-benchproxyrunpy-writes-benchresultsproxyjson"
    )
    assert slug("`controller`") == "controller"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(
                f"{target}: no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}"
            )
        elif not dest.is_relative_to(REPO):
            broken.append(f"{target}: outside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: broken links:\n" + "\n".join(broken)


def test_link_checker_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](#here) and [bad](missing.md) and `[code](ignored.md)`\n\n# Here\n", encoding="utf-8"
    )
    assert links(page) == ["#here", "missing.md"]
    assert anchors(page) == {"here"}


def test_every_doc_is_linked_from_the_readme() -> None:
    linked = {t.partition("#")[0] for t in links(REPO / "README.md")}
    missing = [d.name for d in DOCS if f"docs/{d.name}" not in linked]
    assert not missing, f"docs not linked from README.md: {missing}"


def test_readme_stays_a_front_door() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 200, f"README.md has {lines} lines; move the detail into docs/"


def test_readme_example_config_is_valid() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```yaml\n(.*?)^```", text, re.M | re.S)
    assert blocks, "README.md has no yaml example"
    settings = parse_config(blocks[0], "README.md")
    assert {pool.role for pool in settings.pools.values()} == {"prefill", "decode"}


def test_policy_doc_has_the_reasons_table_markers() -> None:
    text = (REPO / "docs" / "policy.md").read_text(encoding="utf-8")
    begin, end = text.find("<!-- reasons:begin -->"), text.find("<!-- reasons:end -->")
    assert 0 <= begin < end, "docs/policy.md: the reasons table must sit between its markers"
    assert "| `SlowKVTransfer` |" in text[begin:end]
