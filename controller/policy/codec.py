"""The policy's values as JSON and back, exactly: what a stored tick is replayed from.

:func:`dump` turns a frozen policy value (an ``Observation``, a ``PolicyState``, an ``Override``, ...)
into plain JSON types; :func:`load` rebuilds it from its type's annotations, so a value survives
the trip bit for bit (floats are written with ``repr``'s shortest round-trip form, and the
non-finite ones as JSON's ``NaN``/``Infinity`` extensions, which Python reads back).

Decoding is strict: a missing field without a default, an unknown field or a value of the wrong kind raises
:class:`CodecError` naming the path to it (``state.weights.decode-0.smoothed``), so a tick written
by a pdscope with other types is refused rather than replayed as something it was not.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import types
import typing
from collections.abc import Mapping
from functools import cache
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

T = TypeVar("T")

_PLAIN = frozenset({str, int, float, bool, type(None)})


class CodecError(ValueError):
    """A stored value does not fit the type it is read as; ``path`` says where."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path or '<root>'}: {why}")
        self.path = path


class DumpMemo:
    """The documents one :func:`dump` made of the values of ``types`` (frozen dataclasses of plain fields
    only: never changed in place), by identity, for the next dump: a value that is the very same object
    again (a pair's signals the tick before kept, ``controller.observe``) is not dumped again, and its
    document is the same object too (a diff of the two dumps passes it by identity). Each dump's values
    replace the last's (:meth:`turn`), so it holds one dump's worth."""

    def __init__(self, types: tuple[type, ...]) -> None:
        self.types = frozenset(types)
        self._last: dict[int, tuple[Any, dict[str, Any]]] = {}
        self._next: dict[int, tuple[Any, dict[str, Any]]] = {}
        self.taken = 0  # documents taken again, over the memo's life

    def turn(self) -> None:
        """The dump is over: what it made is what the next may take."""
        self._last, self._next = self._next, {}

    def dumped(self, value: Any, fields: tuple[tuple[str, Any], ...], compact: bool) -> dict[str, Any]:
        hit = self._last.get(id(value))
        if hit is not None and hit[0] is value:
            doc = hit[1]
            self.taken += 1
        else:
            doc = _dataclass_dump(value, fields, compact, None)
        self._next[id(value)] = (value, doc)
        return doc


def dump(value: Any, *, compact: bool = False, memo: DumpMemo | None = None) -> Any:
    """``value`` as JSON types (dicts, lists, str, int, float, bool, None). ``compact``: a dataclass
    field equal to its default is left out (:func:`load` fills it in again). ``memo``: the documents of
    the last dump with it, taken again for the same objects (one ``compact`` for every dump with it)."""
    if type(value) in _PLAIN:  # the exact plain types first: most of a record (an enum is not one)
        return value
    cls: type = type(value)
    fields = _fields(cls)
    if fields is not None:  # then a dataclass: most of the rest
        if memo is not None and cls in memo.types:
            return memo.dumped(value, fields, compact)
        return _dataclass_dump(value, fields, compact, memo)
    if value is None or isinstance(value, bool | int | str):
        return value.value if isinstance(value, enum.Enum) else value
    if isinstance(value, float):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, BaseModel):
        return value.model_dump(mode="python")
    if isinstance(value, Mapping):
        return {
            str(k): v if type(v) in _PLAIN else dump(v, compact=compact, memo=memo) for k, v in value.items()
        }
    if isinstance(value, tuple | list):
        return [v if type(v) in _PLAIN else dump(v, compact=compact, memo=memo) for v in value]
    if isinstance(value, frozenset | set):
        return sorted(dump(v, compact=compact, memo=memo) for v in value)
    raise TypeError(f"cannot encode a {type(value).__name__}")


def _dataclass_dump(
    value: Any, fields: tuple[tuple[str, Any], ...], compact: bool, memo: DumpMemo | None
) -> dict[str, Any]:
    """A dataclass's fields, a plain value as it is (no call to :func:`dump` for it: most of a record's
    values), a field equal to its default left out when ``compact`` (``MISSING`` is of no field's type)."""
    out = {}
    for name, default in fields:
        v = getattr(value, name)
        if compact and type(v) is type(default) and v == default and _same(v, default):
            continue
        out[name] = v if type(v) in _PLAIN else dump(v, compact=compact, memo=memo)
    return out


@cache
def _fields(cls: type) -> tuple[tuple[str, Any], ...] | None:
    """A dataclass's fields as :func:`dump` walks them: each name and its plain default (``MISSING``: none),
    worked out once per class (``dataclasses.fields`` builds them anew every call: most of a record's
    encoding at 1,000 instances); None for a class that is no dataclass, or one :func:`dump` encodes as
    its value (an enum, a number or a string, a pydantic model) whatever its fields."""
    if not dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum | int | float | str | BaseModel):
        return None
    return tuple((f.name, f.default) for f in dataclasses.fields(cls))


def _same(v: Any, default: Any) -> bool:
    """``v`` is its field's default exactly (a float NaN is never, 0.0 is not -0.0, 1 is not 1.0)."""
    return (
        type(v) is type(default) and v == default and (not isinstance(v, float) or repr(v) == repr(default))
    )


def load(cls: type[T], data: Any) -> T:
    """Rebuild a ``cls`` from what :func:`dump` wrote; raises :class:`CodecError`."""
    return typing.cast(T, _load(cls, data, ""))


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _load(tp: Any, data: Any, path: str) -> Any:  # noqa: C901 - one branch per kind of annotation
    origin = typing.get_origin(tp)
    if tp is Any:
        return data
    if origin is typing.Union or origin is types.UnionType:
        return _union(typing.get_args(tp), data, path)
    if origin is typing.Literal:
        if data not in typing.get_args(tp):
            raise CodecError(path, f"{data!r} is not one of {typing.get_args(tp)}")
        return data
    if origin is tuple:
        args = typing.get_args(tp)
        items = _list(data, path)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_load(args[0], v, f"{path}[{i}]") for i, v in enumerate(items))
        if len(args) != len(items):
            raise CodecError(path, f"expected {len(args)} items, got {len(items)}")
        return tuple(_load(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, items, strict=True)))
    if origin in (frozenset, set):
        (arg,) = typing.get_args(tp)
        return frozenset(_load(arg, v, f"{path}[{i}]") for i, v in enumerate(_list(data, path)))
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        args = typing.get_args(tp) or (str, Any)
        if not isinstance(data, dict):
            raise CodecError(path, f"expected an object, got {type(data).__name__}")
        return {k: _load(args[1], v, f"{path}.{k}") for k, v in data.items()}
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        try:
            return tp.model_validate(data)
        except ValidationError as exc:
            raise CodecError(path, f"not a {tp.__name__}: {exc.errors()[0]['msg']}") from None
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _dataclass(tp, data, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(data)
        except ValueError:
            raise CodecError(path, f"{data!r} is not a {tp.__name__}") from None
    return _scalar(tp, data, path)


def _union(args: tuple[Any, ...], data: Any, path: str) -> Any:
    if data is None and type(None) in args:
        return None
    problems = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _load(arg, data, path)
        except CodecError as exc:
            problems.append(str(exc))
    raise CodecError(path, "; ".join(problems) or f"{data!r} fits none of {args}")


def _list(data: Any, path: str) -> list[Any]:
    if not isinstance(data, list):
        raise CodecError(path, f"expected a list, got {type(data).__name__}")
    return data


def _dataclass(tp: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise CodecError(path, f"expected a {tp.__name__} object, got {type(data).__name__}")
    hints = _hints(tp)
    fields = {f.name: f for f in dataclasses.fields(tp) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise CodecError(path, f"unknown field(s) of {tp.__name__}: {', '.join(unknown)}")
    missing = sorted(n for n, f in fields.items() if n not in data and not _has_default(f))
    if missing:
        raise CodecError(path, f"missing field(s) of {tp.__name__}: {', '.join(missing)}")
    kwargs = {n: _load(hints[n], data[n], f"{path}.{n}" if path else n) for n in fields if n in data}
    return tp(**kwargs)


def _has_default(f: dataclasses.Field[Any]) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _scalar(tp: Any, data: Any, path: str) -> Any:
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, int | float):
            raise CodecError(path, f"expected a number, got {type(data).__name__}")
        return float(data)
    if tp is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise CodecError(path, f"expected an integer, got {type(data).__name__}")
        return data
    if tp is bool:
        if not isinstance(data, bool):
            raise CodecError(path, f"expected true/false, got {type(data).__name__}")
        return data
    if tp is str:
        if not isinstance(data, str):
            raise CodecError(path, f"expected a string, got {type(data).__name__}")
        return data
    if tp is type(None):
        if data is not None:
            raise CodecError(path, f"expected null, got {type(data).__name__}")
        return None
    raise CodecError(path, f"no decoder for {tp!r}")


def digest(value: Any) -> str:
    """A short stable hash of ``value``'s exact encoding (what a stored state is checked by)."""
    blob = json.dumps(dump(value), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32]
