"""Values as strict JSON can hold them: one home for what the spool and the bundles write.

:func:`plain` keeps ``None``, booleans, strings and finite floats; turns a non-finite float into
``None``, an integer outside 64 bits into a float, a mapping into a dict with string keys, a list or
tuple into a list, and anything else into its ``str()``. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def plain(value: Any) -> Any:
    """``value`` as strict JSON can hold it (see the module docstring)."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value if -(2**63) <= value < 2**64 else float(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return str(value)
