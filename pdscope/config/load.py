"""Reading the config file: bounded YAML, then :class:`Settings`, or one line per problem.

:func:`parse_config` and :func:`load_config` are the only ways in: the size of the file and of
its YAML (aliases expanded) is bounded before anything is built, a duplicate key is an error, and
each pydantic error becomes one line naming the file, the line and the dotted field.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pdscope.config.base import ConfigError
from pdscope.config.settings import Settings

DEFAULT_CONFIG_ENV = "PDSCOPE_CONFIG"


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (PyYAML silently keeps the last)."""


def _construct_mapping(
    loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False
) -> dict[Any, Any]:
    mapping: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in mapping:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


@dataclass(frozen=True)
class _Located:
    """Line numbers (1-based) of each dotted path in a YAML document."""

    lines: dict[tuple[str | int, ...], int]

    def line_of(self, path: tuple[str | int, ...]) -> int | None:
        # The deepest known ancestor: an unknown key or a missing field points at its parent.
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return None


def _locate(node: yaml.Node | None) -> _Located:
    lines: dict[tuple[str | int, ...], int] = {}

    def walk(n: yaml.Node, path: tuple[str | int, ...]) -> None:
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                sub = (*path, str(k.value))
                lines[sub] = k.start_mark.line + 1
                walk(v, sub)
        elif isinstance(n, yaml.SequenceNode):
            for i, v in enumerate(n.value):
                sub = (*path, i)
                lines[sub] = v.start_mark.line + 1
                walk(v, sub)

    if node is not None:
        walk(node, ())
    return _Located(lines)


def _format_error(source: str, located: _Located, err: Mapping[str, Any]) -> str:
    ctx = err.get("ctx") or {}
    # A validator that knows better (a duplicate instance) names the exact field in ctx["loc"].
    loc = tuple(ctx["loc"]) if isinstance(ctx.get("loc"), tuple) else tuple(err["loc"])
    bad_key = bool(loc) and loc[-1] == "[key]"
    if bad_key:  # a bad mapping key: name the key itself (its line), not pydantic's marker
        loc = loc[:-1]
    field = ".".join(str(p) for p in loc) or "(top level)"
    line = located.line_of(loc)
    where = f"{source}:{line}" if line else source
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    first = ctx.get("first")
    if isinstance(first, tuple) and (first_line := located.line_of(first)):
        first_field = ".".join(str(p) for p in first[:-1])
        msg = msg.replace(f"at {first_field}", f"at {first_field} (line {first_line})", 1)
    if err["type"] == "extra_forbidden":
        msg = "unknown key (not a pdscope setting; check its spelling and indentation)"
    elif err["type"] == "missing":
        msg = "required field is missing"
    elif (
        "input" in err
        and not bad_key
        and "loc" not in ctx
        and err["type"] not in ("model_type", "dict_type", "list_type")
    ):
        shown = repr(err["input"])
        if len(shown) <= 60:
            msg = f"{msg} (got {shown})"
    return f"{where}: {field}: {msg}"


# Bounds on what a config file may cost to read: its size, and the number of values after
# YAML aliases are expanded (an alias bomb -- "billion laughs" -- is a few hundred bytes
# that expand to billions of values). Both are far above any real fleet's file.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_VALUES = 200_000


def _expanded_size_over(node: yaml.Node, limit: int) -> bool:
    """Whether ``node`` expands to more than ``limit`` values, counting every alias use.

    Aliases share node objects, so the count follows each reference; it stops at ``limit``,
    which also ends a recursive alias (a node that contains itself).
    """
    count = 0
    stack: list[yaml.Node] = [node]
    while stack:
        n = stack.pop()
        count += 1
        if count > limit:
            return True
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                stack.append(k)
                stack.append(v)
        elif isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)
    return False


def _compose(text: str, source: str) -> tuple[yaml.Node | None, Any]:
    """Compose (bounded), then construct, the one YAML document in ``text``."""
    size = len(text.encode("utf-8", errors="replace"))
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            [f"{source}: the file is {size} bytes; a config may be at most {MAX_CONFIG_BYTES} bytes"]
        )
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        if _expanded_size_over(node, MAX_CONFIG_VALUES):
            raise ConfigError(
                [
                    f"{source}: more than {MAX_CONFIG_VALUES} values once YAML aliases (*name) are "
                    "expanded; refusing to read it (an alias bomb?)"
                ]
            )
        return node, loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([f"{where}: not valid YAML: {problem}"]) from exc
    except RecursionError as exc:
        raise ConfigError([f"{source}: not valid YAML: nested too deeply"]) from exc
    finally:
        loader.dispose()


def parse_config(text: str, source: str = "<config>") -> Settings:
    """Parse and validate YAML text. Raises :class:`ConfigError` with one line per problem."""
    node, data = _compose(text, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"{source}: the top level must be a mapping of sections (model, pools, ...)"])
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        located = _locate(node)
        raise ConfigError([_format_error(source, located, e) for e in exc.errors()]) from exc


def load_config(path: str | os.PathLike[str]) -> Settings:
    """Read and validate a config file. Raises :class:`ConfigError`."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)  # never more than the limit, whatever the file's size
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError([f"{p}: larger than {MAX_CONFIG_BYTES} bytes; a config may be at most that"])
        text = raw.decode("utf-8")
    except OSError as exc:
        raise ConfigError([f"{p}: cannot read: {exc.strerror or exc}"]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{p}: not UTF-8 text: {exc.reason} at byte {exc.start}"]) from exc
    return parse_config(text, str(p))


def resolve_config_path(cli_value: str | None, environ: Mapping[str, str] | None = None) -> Path:
    """``--config`` wins, then ``$PDSCOPE_CONFIG``, then ``./pdscope.yaml``."""
    env = os.environ if environ is None else environ
    return Path(cli_value or env.get(DEFAULT_CONFIG_ENV) or "pdscope.yaml")


def load_settings(args: argparse.Namespace) -> Settings:
    """The settings a ``pdscope`` subcommand runs with: the file ``args.config`` names (else
    ``$PDSCOPE_CONFIG``, else ``./pdscope.yaml``), read and validated once. Raises
    :class:`ConfigError`, which the command line prints one problem a line."""
    return load_config(resolve_config_path(args.config))
