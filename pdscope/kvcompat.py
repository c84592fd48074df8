"""Whether a P and a D can hand KV to each other: the fields compared, their bounds, and the rule.

D pulls KV blocks out of P's cache into its own, so both must run the same model (the same layers
and KV heads), lay the cache out in blocks of the same size and dtype, and, during a rollout, run
the same revision. An instance's **identity** is what it reports of these :data:`FIELDS`:

- ``model``: the ``model_name`` label of vLLM's own metrics (the served model name, the ``id`` that
  ``/v1/models`` lists); the layers and KV heads follow from the model, which vLLM's metrics do not
  carry on their own;
- ``block_size``, ``cache_dtype``: labels of ``vllm:cache_config_info`` (set once, at engine start);
- ``revision``: from the config (a pool's or an instance's ``revision``), never from the instance.

The rule (:func:`compare`), per field:

- neither side reports it: not compared (a vLLM without the metric, a fleet without revisions);
- both report it, valid: equal, or the pair is **incompatible** (the field is named);
- one side reports it and the other does not, or either value is malformed (over
  :data:`MAX_CHARS`, the wrong shape, engines of one instance that disagree): **unknown**, never
  compatible.

A field that differs makes the pair incompatible whatever the others say; otherwise a field unknown
makes it unknown; otherwise it is compatible. Label values are untrusted: nothing here raises on
them. Pure, kernel vocabulary: the collector extracts the identity, the controller judges pairs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

FIELDS: tuple[str, ...] = ("model", "block_size", "cache_dtype", "revision")
MAX_CHARS = 256  # a reported value longer than this is malformed (and is stored cut to this)
MALFORMED = "?malformed"  # what the collector stores for a value it cannot keep (too long, engines disagree)

Identity = tuple[tuple[str, str], ...]  # (field, value) pairs, sorted; a field left out is not reported
Status = Literal["compatible", "incompatible", "unknown"]

_BLOCK_SIZE = re.compile(r"[1-9][0-9]{0,6}")
_DTYPE = re.compile(r"[A-Za-z0-9_.]{1,32}")
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")


def _printable(value: str) -> bool:
    return 0 < len(value) <= MAX_CHARS and value.isprintable()


_VALID: dict[str, Callable[[str], bool]] = {
    "model": _printable,
    "block_size": lambda v: _BLOCK_SIZE.fullmatch(v) is not None,
    "cache_dtype": lambda v: _DTYPE.fullmatch(v) is not None,
    "revision": lambda v: _REVISION.fullmatch(v) is not None,
}


def valid(field: str, value: str) -> bool:
    """Is ``value`` a well-formed ``field``?"""
    check = _VALID.get(field)
    return check is not None and value != MALFORMED and check(value)


def kept(value: str) -> str:
    """A reported label value as the collector stores it: cut to :data:`MAX_CHARS` + 1 (so that a longer
    one stays malformed)."""
    return value[: MAX_CHARS + 1]


def identity(values: Mapping[str, str]) -> Identity:
    """``values`` (field -> value) as an :data:`Identity`: the known fields only, sorted, values kept."""
    return tuple(sorted((f, kept(v)) for f, v in values.items() if f in FIELDS and isinstance(v, str)))


@dataclass(frozen=True)
class Verdict:
    """A pair's status, the fields that decided it, and a sentence saying why."""

    status: Status
    fields: tuple[str, ...] = ()
    text: str = ""


def _show(value: str | None) -> str:
    if value is None:
        return "not reported"
    return repr(value[:40] + "…") if len(value) > 40 else repr(value)


def compare(p: Identity, d: Identity) -> Verdict:
    """The rule (module docstring) for P's identity ``p`` and D's ``d``."""
    mine, theirs = dict(p), dict(d)
    differ: list[str] = []
    unknown: list[str] = []
    for f in FIELDS:
        a, b = mine.get(f), theirs.get(f)
        if a is None and b is None:
            continue
        if a is None or b is None or not valid(f, a) or not valid(f, b):
            unknown.append(f)
        elif a != b:
            differ.append(f)
    if differ:
        why = "; ".join(f"{f} {_show(mine.get(f))} vs {_show(theirs.get(f))}" for f in differ)
        return Verdict("incompatible", tuple(differ), f"P and D differ: {why}")
    if unknown:
        why = "; ".join(f"{f} {_show(mine.get(f))} vs {_show(theirs.get(f))}" for f in unknown)
        return Verdict("unknown", tuple(unknown), f"missing or malformed on one side: {why}")
    return Verdict("compatible")
