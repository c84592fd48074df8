"""What every section of the config is made of: the error, the frozen base model, the bounded types.

A field is one line, ``name: Type = default``, with its description in the string right under it
(an attribute docstring: ``use_attribute_docstrings``, which pydantic reads from the source into the
field's ``description``). Written as ``Field(default=..., description=...)`` every field took four
lines of one shape, and a section read as one long repetition. A bound goes in the type: a bounded
type is a type with its bounds (``Annotated[float, Field(gt=0, le=3600)]``). The bounds land in the
field's metadata exactly as if written in its ``Field``, so validation, the error messages and the
generated reference (``pdscope.configdoc``) do not tell the two apart. A bound used once stays in
its field's ``Field(default=..., ge=...)``; so does one on an optional field (``float | None``),
where a bounded type would bound only one branch of the union.

Imports nothing of pdscope: the sections build on it.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

_M = TypeVar("_M", bound=BaseModel)


class ConfigError(Exception):
    """The configuration file is missing, unreadable or invalid.

    ``problems`` holds one human-readable line per problem; ``str()`` joins them.
    """

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def validated(model: type[_M], data: Any, source: str, whole: str) -> _M:
    """``data`` as a ``model``; a ConfigError with a line ``source: field.path: message`` a problem
    (``whole``: the field named for a problem with all of ``data``)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(
            [f"{source}: {'.'.join(str(p) for p in e['loc']) or whole}: {e['msg']}" for e in exc.errors()]
        ) from exc


class _Frozen(BaseModel):
    # allow_inf_nan=False: every float in the file must be finite (``.inf``, ``.nan`` and
    # ``1e400`` are refused for intervals, weights and targets alike). One rule, every section.
    # use_attribute_docstrings: a field's description is the string under it (see above).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, use_attribute_docstrings=True)


# -- numbers -------------------------------------------------------------------------------

# > 0, no upper bound: an interval, a target, a timeout that is the operator's call.
PositiveFloat = Annotated[float, Field(gt=0)]

# >= 0, no upper bound: a wait or a margin that may be none.
NonNegative = Annotated[float, Field(ge=0)]

# A duration in (0, 1 hour].
Seconds = Annotated[float, Field(gt=0, le=3600)]

# A duration in (0, 1 day].
DaySeconds = Annotated[float, Field(gt=0, le=86400)]

# A share in [0, 1]; 0 is allowed (it turns the thing off, or gives nothing).
Fraction = Annotated[float, Field(ge=0, le=1)]

# A share in (0, 1].
PositiveFraction = Annotated[float, Field(gt=0, le=1)]

# > 0, no upper bound: a size in bytes or characters, a limit.
PositiveInt = Annotated[int, Field(gt=0)]

# A count in [1, 10,000].
Count10k = Annotated[int, Field(ge=1, le=10_000)]

# A count in [1, 100,000].
Count100k = Annotated[int, Field(ge=1, le=100_000)]

# A count in [1, 1,000,000].
Count1M = Annotated[int, Field(ge=1, le=1_000_000)]

# A TCP port a service listens on.
Port = Annotated[int, Field(ge=1, le=65535)]

# -- strings -------------------------------------------------------------------------------

# A string of at least one character: a name, the NAME of an environment variable.
NonEmpty = Annotated[str, Field(min_length=1)]

# An item of a list or a key of a map that names something: 1-64 characters.
ShortName = Annotated[str, Field(min_length=1, max_length=64)]
