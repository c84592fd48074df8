"""The model's tokenizer in the proxy: a request's prompt as the token ids vLLM will cache.

The precise KV-aware view (``proxy.precise``) matches a prompt's block chain against vLLM's KV
events, which carry token ids, so the proxy must produce the ids vLLM produces for the same
body. ``model.tokenizer`` names where they come from (:func:`load_tokenizer`):

- ``pdscope-sim``: the simulator's tokenizer (``pdscope.simtokenizer``), for simulated fleets.
- a directory holding a HuggingFace ``tokenizer.json`` (and, for chats, ``tokenizer_config.json``
  with ``chat_template``, ``bos_token``, ``eos_token``, or a ``chat_template.jinja`` beside it),
  or the path of a ``tokenizer.json`` itself (its directory is searched for the rest). Loaded
  with the ``tokenizers`` library alone; the chat template is rendered with jinja2 the way
  HuggingFace renders it (a sandbox, ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception``,
  ``strftime_now``, ``tojson``, a ``{% generation %}`` block that renders its body).

vLLM's two paths, kept exactly: a completion's text is encoded *with* the tokenizer's special
tokens (its BOS), a chat's rendered template *without* them (the template writes its own),
unless the body's ``add_special_tokens`` says otherwise; ``add_generation_prompt`` defaults to
true and ``chat_template_kwargs`` reach the template; token ids in ``prompt`` are used as they
are; ``truncate_prompt_tokens`` keeps the last ids, as vLLM does. What :mod:`proxy.prompts`
refuses, and a template that raises or fails, is ``None``: this request is routed on load alone.
:meth:`Tokenizer.ids` never raises; every refusal is counted in ``refused`` by reason.

Errors: :class:`TokenizerError` (a ``ValueError``) at load time only, naming the path and what
is wrong with it; the config layer reports it under ``model.tokenizer``.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
import tokenizers

from pdscope import simtokenizer
from proxy.prompts import DEFAULT_MAX_CHARS, Chat, Ids, Refused, Text, kept, prompt_of

log = logging.getLogger(__name__)

# Names the renderer itself sets; a request's chat_template_kwargs cannot override them.
_RESERVED = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token", "unk_token"}
    | {"pad_token", "raise_exception", "strftime_now", "chat_template"}
)


class TokenizerError(ValueError):
    """``model.tokenizer`` names nothing loadable; the message says which path and why."""


class Tokenizer(Protocol):
    refused: Counter[str]  # prompts not tokenized, by reason

    def ids(self, endpoint: str, body: Mapping[str, Any]) -> list[int] | None:
        """The token ids vLLM computes for the prompt of ``body``, or None when this cannot be
        known here (see the module docstring). Never raises."""
        ...


class SimTokenizer:
    """The simulator's: one id per word, a fixed four-token frame per chat message."""

    def __init__(self, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        self.max_chars = max_chars
        self.refused: Counter[str] = Counter()

    def ids(self, endpoint: str, body: Mapping[str, Any]) -> list[int] | None:
        p = prompt_of(endpoint, body, self.max_chars)
        if isinstance(p, Refused):
            self.refused[p.reason] += 1
            return None
        if isinstance(p, Ids):
            return kept(p.ids, body)
        if isinstance(p, Text):
            return kept(simtokenizer.text_ids(p.text), body)
        return kept(simtokenizer.chat_ids(p.messages), body)


class HfTokenizer:
    """A HuggingFace ``tokenizer.json`` and, optionally, its chat template."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        template: jinja2.Template | None,
        specials: Mapping[str, str | None],
        max_chars: int = DEFAULT_MAX_CHARS,
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.specials = dict(specials)
        self.max_chars = max_chars
        self.refused: Counter[str] = Counter()

    def ids(self, endpoint: str, body: Mapping[str, Any]) -> list[int] | None:
        try:
            p = prompt_of(endpoint, body, self.max_chars)
            if isinstance(p, Refused):
                reason = p.reason
            elif isinstance(p, Ids):
                return kept(p.ids, body)
            elif isinstance(p, Text):
                return kept(self._encode(p.text, _flag(body, "add_special_tokens", True)), body)
            else:
                text = self.render(p, body)
                if text is None:
                    reason = "no_template" if self.template is None else "template"
                elif len(text) > self.max_chars:
                    reason = "too_long"
                else:
                    return kept(self._encode(text, _flag(body, "add_special_tokens", False)), body)
        except Exception:  # a tokenizer bug must not fail the request: it is routed on load alone
            log.exception("tokenizer: a prompt could not be tokenized")
            reason = "error"
        self.refused[reason] += 1
        return None

    def _encode(self, text: str, special: bool) -> list[int]:
        # The batch-of-one "fast" path computes no character offsets: the same ids for about 30%
        # less CPU than ``encode`` (measured on a 2,000-token chat).
        return list(self.tokenizer.encode_batch_fast([text], add_special_tokens=special)[0].ids)

    def render(self, chat: Chat, body: Mapping[str, Any]) -> str | None:
        """The chat template rendered for ``chat``; None without a template or when it fails."""
        if self.template is None:
            return None
        context: dict[str, Any] = {}
        kwargs = body.get("chat_template_kwargs")
        if isinstance(kwargs, dict):
            context.update((k, v) for k, v in kwargs.items() if isinstance(k, str) and k not in _RESERVED)
        tools = body.get("tools")
        context.update((k, v) for k, v in self.specials.items() if v is not None)  # unset: undefined, ""
        context.update(
            messages=chat.messages,
            tools=tools if isinstance(tools, list) else None,
            documents=None,
            add_generation_prompt=_flag(body, "add_generation_prompt", True),
        )
        try:
            return self.template.render(context)
        except Exception as exc:  # raise_exception, a sandbox refusal, a type error: the template's verdict
            log.debug("tokenizer: the chat template failed on a request: %s", exc)
            return None


def _flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    return value if isinstance(value, bool) else default


# -- loading ------------------------------------------------------------------------------


def load_tokenizer(spec: str, *, max_chars: int = DEFAULT_MAX_CHARS) -> Tokenizer:
    """The tokenizer ``spec`` names (see the module docstring); raises :class:`TokenizerError`."""
    if spec == simtokenizer.NAME:
        return SimTokenizer(max_chars)
    path = Path(spec).expanduser()
    if path.is_dir():
        folder, file = path, path / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"{path}: a directory without a tokenizer.json")
    elif path.is_file():
        folder, file = path.parent, path
    else:
        raise TokenizerError(f"{path}: no such file or directory (a tokenizer.json or its directory)")
    tok = _read_tokenizer(file)
    config = _read_config(folder / "tokenizer_config.json")
    template_text = _template_text(config, folder)
    specials = {name: _special(config, name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    template = _compile(template_text, folder) if template_text is not None else None
    return HfTokenizer(tok, template, specials, max_chars)


def _read_tokenizer(file: Path) -> tokenizers.Tokenizer:
    try:
        tok = tokenizers.Tokenizer.from_file(str(file))
    except Exception as exc:  # the library raises a bare Exception for unreadable or malformed files
        raise TokenizerError(f"{file}: not a tokenizer.json the tokenizers library can load: {exc}") from exc
    # A tokenizer.json may carry truncation or padding from its training; vLLM's tokenizer does
    # neither to a prompt, so neither may the proxy (a truncated prompt keys the wrong blocks).
    tok.no_truncation()
    tok.no_padding()
    return tok


def _read_config(file: Path) -> dict[str, Any]:
    if not file.exists():
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{file}: cannot be read as JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise TokenizerError(f"{file}: a JSON {type(config).__name__}, not an object")
    return config


def _template_text(config: Mapping[str, Any], folder: Path) -> str | None:
    """The chat template: ``chat_template`` in the config (a string, or a list of named templates
    whose ``default`` is used), else ``chat_template.jinja`` beside it, else none."""
    raw = config.get("chat_template")
    where = folder / "tokenizer_config.json"
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        raw = named.get("default")
        if raw is None:
            raise TokenizerError(f"{where}: chat_template is a list without a template named 'default'")
    if raw is not None:
        if not isinstance(raw, str):
            raise TokenizerError(f"{where}: chat_template is a {type(raw).__name__}, not a string")
        return raw
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"{jinja_file}: cannot be read: {exc}") from exc
    return None


def _special(config: Mapping[str, Any], name: str) -> str | None:
    """A special token as the config writes it: a string, or a dict with its ``content``."""
    value = config.get(name)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


# -- the template environment (HuggingFace's conventions) --------------------------------


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (HuggingFace marks assistant turns with it): the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _compile(text: str, folder: Path) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(text)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"{folder}: its chat_template is not a valid jinja template: {exc}") from exc
