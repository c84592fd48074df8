"""Keep docs/policy.md's reasons table equal to ``pdscope.reasons``.

    python -m controller.reasons_doc            # print the table
    python -m controller.reasons_doc --write    # rewrite it in docs/policy.md, between its markers
    python -m controller.reasons_doc --check    # exit 1 when docs/policy.md is stale

Writes nothing but docs/policy.md (with --write).
"""

from __future__ import annotations

import sys
from pathlib import Path

from pdscope.reasons import reasons_markdown, splice

POLICY_DOC = Path(__file__).resolve().parents[1] / "docs" / "policy.md"


def current(doc: str) -> bool:
    return splice(doc, reasons_markdown()) == doc


def main(argv: list[str] | None = None, path: Path = POLICY_DOC) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        sys.stdout.write(reasons_markdown())
        return 0
    if not path.is_file():
        print(f"{path}: not found (run from a checkout of pdscope)", file=sys.stderr)
        return 1
    doc = path.read_text(encoding="utf-8")
    if args == ["--check"]:
        if current(doc):
            return 0
        print(
            f"{path}: the reasons table is stale; run: python -m controller.reasons_doc --write",
            file=sys.stderr,
        )
        return 1
    if args == ["--write"]:
        path.write_text(splice(doc, reasons_markdown()), encoding="utf-8")
        return 0
    print("usage: python -m controller.reasons_doc [--write | --check]", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
