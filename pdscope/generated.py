"""Write a generated file, or with ``--check`` only report that the one on disk is stale.

The command line shared by the scripts under deploy/ that render a checked-in file from
its sources (deploy/grafana/build_dashboard.py, deploy/k8s/render_configmaps.py). It
renders nothing itself and writes no file but ``out``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def write_or_check(
    argv: Sequence[str] | None, doc: str | None, out: Path, render: Callable[[], str], script: str
) -> int:
    """Parse ``[--check]``; write ``render()`` to ``out``, or return 1 when ``out`` differs from it.

    ``doc`` is the script's docstring (its first line is the ``--help`` description) and
    ``script`` its path from the repository root, named in the stale message.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--check", action="store_true", help=f"exit 1 if {out.name} on disk is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not out.exists() or out.read_text() != text:
            print(f"{out} is stale: run python {script}", file=sys.stderr)
            return 1
        return 0
    out.write_text(text)
    return 0
