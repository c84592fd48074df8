"""Bounds on the command line's numbers: each command's table of the options that size memory or time
(``--bucket-s``, ``--limit``, ``--max-records``...), checked first in its ``run`` so that NaN, an
infinity or a value out of ``[lo, hi]`` is refused before anything runs, with the usage error's exit 2
and a line naming the option: ``pdscope whatif: --bucket-s: must be a finite number from 0.1 to 3600``.
A command's other refusals take the same form (:func:`fail`).

This module reads no config and opens nothing.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping

# whatif: a fit's time buckets over the window at most (a 30 min window at 1e-5 s buckets was 16 GB)
MAX_BUCKETS = 100_000
# --from / --until: Unix seconds from 0 to 1e11 (the year 5138)
UNIX_S: tuple[float, float] = (0.0, 1e11)
WINDOW: Mapping[str, tuple[float, float]] = {"from_": UNIX_S, "until": UNIX_S}


def problem(args: argparse.Namespace, bounds: Mapping[str, tuple[float, float]]) -> str | None:
    """``--option: reason`` for the first of ``bounds`` (attribute name -> inclusive (lo, hi)) that is set
    and not a finite number in its range; None when all are."""
    for attr, (lo, hi) in bounds.items():
        value = getattr(args, attr, None)
        if value is None:
            continue
        flag = "--" + attr.rstrip("_").replace("_", "-")
        if not math.isfinite(value) or not lo <= value <= hi:
            return f"{flag}: must be a finite number from {lo:g} to {hi:g} (got {value!r})"
    return None


def refuse(command: str, args: argparse.Namespace, bounds: Mapping[str, tuple[float, float]]) -> int | None:
    """Print the :func:`problem` as ``pdscope <command>: ...`` and answer 2; None when there is none."""
    found = problem(args, bounds)
    if found is None:
        return None
    return fail(command, found, 2)


def fail(command: str, message: str, code: int = 1) -> int:
    """Print ``pdscope <command>: message`` on stderr and answer ``code``, the exit status."""
    print(f"pdscope {command}: {message}", file=sys.stderr)
    return code
