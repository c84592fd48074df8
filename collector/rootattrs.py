"""A proxy root span's attributes checked against what they mean: what the predictor's fields
(``collector.predicted``) and the KV-aware routing fields (``collector.assemble.routing``) share.

Each field has a check: its value in, the value it means out, or None when it is not one. A key
that is present but fails its check is left out and named in ``dropped`` (the record's ``dropped``
notes, which the sink counts).

Pure: attributes in, values out; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Final

MAX_TOKENS: Final = 10**9  # a token count above this is not one (no prompt is that long)

Check = Callable[[Any], Any]  # a present value in, what it means out (None: invalid)


def token_count(value: Any) -> int | None:
    """An integral token count in [0, MAX_TOKENS] (an int, or a float or string that is one), or None."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    if isinstance(value, int):
        n = value
    else:
        try:
            f = float(value)
        except (ValueError, OverflowError):
            return None
        if not math.isfinite(f) or f != int(f):
            return None
        n = int(f)
    return n if 0 <= n <= MAX_TOKENS else None


def checked(attrs: dict[str, Any], checks: Iterable[tuple[str, Check]]) -> tuple[list[Any], tuple[str, ...]]:
    """The value of each ``(key, check)`` in ``attrs`` as its check reads it (None: absent or
    invalid), and the keys present but invalid, both in the order of ``checks``."""
    values: list[Any] = []
    dropped: list[str] = []
    for key, check in checks:
        raw = attrs.get(key)
        value = check(raw) if raw is not None else None
        if raw is not None and value is None:
            dropped.append(key)
        values.append(value)
    return values, tuple(dropped)
