"""Every decision reason is one ``Reason``, described once, and the docs table is generated from them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from controller import reasons_doc
from pdscope.reasons import BEGIN, END, Reason, reasons_markdown, splice

REPO = Path(__file__).resolve().parents[2]


def test_every_reason_is_described_and_compares_equal_to_its_stored_string() -> None:
    for r in Reason:
        decides, when = Reason.describe(r)
        assert decides.strip() and len(when) > 15, r
        assert r == r.value and f"{r}" == r.value and Reason.of(r.value) is r
    assert Reason.of("SomethingANewerVersionWrote") is Reason.INITIAL


def test_no_reason_is_a_bare_string_in_the_policy() -> None:
    """A CamelCase string literal in the policy that names a reason must be the enum member instead."""
    values = {r.value for r in Reason}
    offenders = []
    for path in (REPO / "controller" / "policy").glob("*.py"):
        if path.name in ("reasons.py", "alerts.py"):  # alerts.py names alert rules (InstanceDown is both)
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in values:
                offenders.append(f"{path.name}:{node.lineno}: {node.value!r}")
    assert not offenders, offenders


def test_docs_policy_md_reasons_table_is_current() -> None:
    doc = (REPO / "docs" / "policy.md").read_text(encoding="utf-8")
    assert reasons_doc.current(doc), "docs/policy.md is stale: run python -m controller.reasons_doc --write"
    for r in Reason:
        assert f"| `{r.value}` |" in doc


def test_the_check_fails_on_a_stale_table_and_write_fixes_it(tmp_path: Path) -> None:
    doc = tmp_path / "policy.md"
    doc.write_text(f"# Policy\n\n{BEGIN}\n| `Healthy` | old |\n{END}\ntail\n", encoding="utf-8")
    assert reasons_doc.main(["--check"], doc) == 1
    assert reasons_doc.main(["--write"], doc) == 0
    assert reasons_doc.main(["--check"], doc) == 0
    text = doc.read_text(encoding="utf-8")
    assert text.startswith("# Policy\n") and text.endswith(f"{END}\ntail\n") and reasons_markdown() in text
    with pytest.raises(ValueError, match="markers"):
        splice("no markers here", reasons_markdown())
