"""What the instances serve: their models (with ``max_model_len``) and vLLM versions, learnt in the
background from each instance's ``GET /v1/models`` and ``GET /version``.

:class:`ModelCatalog` is the pure state (clock passed in): the last answer of every instance in the
routing view, and what the proxy derives from them -- the context length a request is checked
against (:meth:`ModelCatalog.max_model_len`: the smallest over the instances serving that model),
the models both roles serve (the proxy's own ``/v1/models``), the vLLM versions per role. An
instance that leaves the routing view is forgotten.

:func:`learn_forever` is the I/O: every ``refresh_s`` it asks each instance, with a per-request
timeout, at most :data:`MAX_BODY_BYTES` read of an answer and at most :data:`MAX_MODELS` models kept
per instance. A failed or malformed answer keeps the instance's last good one and is counted
(``pdscope_proxy_model_info_errors_total{instance,reason}``, :attr:`ModelCatalog.errors`). It never
blocks a request: requests read the catalog as it stands (empty until the first answers: nothing
checked against a length not yet learnt).

Errors: :class:`ModelInfoError` (with a short ``reason``) inside one fetch only; nothing escapes the
loop but cancellation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20  # one instance's /v1/models or /version answer, read at most
MAX_MODELS = 256  # models kept per instance (a base model and its LoRA adapters)
MAX_ID_CHARS = 512  # a model id (vLLM's served name or an adapter's name)
MAX_CONTEXT = 1 << 31  # a max_model_len above this is not believed


class ModelInfoError(Exception):
    """One instance's answer could not be used; ``reason`` labels the counter."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ModelCard:
    """One entry of vLLM's ``/v1/models`` (the fields the proxy keeps)."""

    id: str
    created: int
    owned_by: str
    root: str | None
    parent: str | None
    max_model_len: int | None  # None for a LoRA adapter: its parent's applies


@dataclass(frozen=True, slots=True)
class Member:
    """An instance the catalog asks: its name, role (``prefill``/``decode``) and base URL."""

    name: str
    role: str
    url: str


@dataclass
class _Known:
    role: str
    models: tuple[ModelCard, ...] = ()
    version: str | None = None
    learnt_at: float | None = None
    failing: str | None = None  # the reason of the last failed ask; None after a good one


def _str(value: Any, what: str, limit: int = MAX_ID_CHARS) -> str:
    if not isinstance(value, str) or not value or len(value) > limit:
        raise ModelInfoError("malformed", f"{what} must be a non-empty string of at most {limit} chars")
    return value


def _card(item: Any) -> ModelCard:
    if not isinstance(item, dict):
        raise ModelInfoError("malformed", "a model entry is not an object")
    mml = item.get("max_model_len")
    if mml is not None and (type(mml) is not int or not 1 < mml <= MAX_CONTEXT):
        raise ModelInfoError("malformed", f"max_model_len must be an integer in (1, {MAX_CONTEXT}]")
    created = item.get("created")
    parent, root, owner = item.get("parent"), item.get("root"), item.get("owned_by")
    return ModelCard(
        id=_str(item.get("id"), "id"),
        created=created if type(created) is int and created >= 0 else 0,
        owned_by=owner if isinstance(owner, str) and len(owner) <= MAX_ID_CHARS else "vllm",
        root=root if isinstance(root, str) and len(root) <= 4096 else None,
        parent=_str(parent, "parent") if parent is not None else None,
        max_model_len=mml,
    )


def parse_models(data: Any) -> tuple[ModelCard, ...]:
    """vLLM's ``/v1/models`` JSON (``{"object": "list", "data": [...]}``) as cards; raises
    :class:`ModelInfoError` for any other shape. At most :data:`MAX_MODELS` are kept."""
    items = data.get("data") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise ModelInfoError("malformed", "no data list")
    return tuple(_card(item) for item in items[:MAX_MODELS])


def parse_version(data: Any) -> str:
    """vLLM's ``/version`` JSON (``{"version": "0.33.0"}``); raises :class:`ModelInfoError`."""
    return _str(data.get("version") if isinstance(data, dict) else None, "version", 64)


@dataclass
class ModelCatalog:
    """The instances' last answers; every read is a pure function of them."""

    known: dict[str, _Known] = field(default_factory=dict)
    errors: Counter[tuple[str, str]] = field(default_factory=Counter)  # (instance, reason) -> count
    on_error: Callable[[str, str], None] | None = None  # (instance, reason): the proxy's counter

    def retain(self, members: Iterable[Member]) -> None:
        """Forget the instances not in ``members``; give the new ones a (still empty) entry."""
        want = {m.name: m.role for m in members}
        for name in [n for n in self.known if n not in want]:
            del self.known[name]
        for name, role in want.items():
            entry = self.known.setdefault(name, _Known(role))
            entry.role = role

    def learnt(self, name: str, models: tuple[ModelCard, ...], version: str | None, now: float) -> None:
        entry = self.known.get(name)
        if entry is None:
            return  # it left the view while it was asked
        entry.models, entry.learnt_at, entry.failing = models, now, None
        if version is not None:
            entry.version = version

    def failed(self, name: str, reason: str) -> None:
        self.errors[(name, reason)] += 1
        if self.on_error is not None:
            self.on_error(name, reason)
        entry = self.known.get(name)
        if entry is not None:
            entry.failing = reason

    def unreachable(self, name: str) -> bool:
        """Did the last ask of ``name`` fail to reach it at all (no connection, or no answer in time)?"""
        entry = self.known.get(name)
        return entry is not None and entry.failing in ("connect", "timeout")

    def _lengths(self, model: str) -> list[int]:
        out: list[int] = []
        for entry in self.known.values():
            by_id = {c.id: c for c in entry.models}
            card = by_id.get(model)
            if card is None:
                continue
            if card.max_model_len is None and card.parent is not None:
                card = by_id.get(card.parent, card)  # a LoRA adapter: its base model's length
            if card.max_model_len is not None:
                out.append(card.max_model_len)
        return out

    def max_model_len(self, model: str | None) -> int | None:
        """The context length a request for ``model`` must fit: the smallest that any instance serving
        it reports. ``None`` (nothing to check against): no instance reports the model, or ``model`` is
        absent and the instances do not all serve the same single base model."""
        if model is None:
            bases = {c.id for e in self.known.values() for c in e.models if c.parent is None}
            if len(bases) != 1:
                return None
            model = bases.pop()
        lengths = self._lengths(model)
        return min(lengths) if lengths else None

    def served(self) -> list[ModelCard]:
        """The models served by at least one P and at least one D, in the first P's order, each with the
        smallest ``max_model_len`` over the instances serving it."""
        by_role: dict[str, dict[str, list[ModelCard]]] = {"prefill": {}, "decode": {}}
        for entry in self.known.values():
            for card in entry.models:
                by_role.setdefault(entry.role, {}).setdefault(card.id, []).append(card)
        p, d = by_role["prefill"], by_role["decode"]
        out: list[ModelCard] = []
        for model_id, cards in p.items():
            if model_id not in d:
                continue
            every = cards + d[model_id]
            lengths = [c.max_model_len for c in every if c.max_model_len is not None]
            out.append(
                ModelCard(
                    id=model_id,
                    created=min(c.created for c in every),
                    owned_by=cards[0].owned_by,
                    root=cards[0].root,
                    parent=cards[0].parent,
                    max_model_len=min(lengths) if lengths else None,
                )
            )
        return out

    def versions(self) -> dict[str, list[str]]:
        """The distinct vLLM versions each role's instances reported, sorted."""
        out: dict[str, set[str]] = {}
        for entry in self.known.values():
            if entry.version is not None:
                out.setdefault(entry.role, set()).add(entry.version)
        return {role: sorted(v) for role, v in sorted(out.items())}


# -- the I/O ------------------------------------------------------------------------------------

Fetch = Callable[[str], Awaitable[Any]]  # a URL -> its JSON; raises ModelInfoError


def http_fetch(client: httpx.AsyncClient) -> Fetch:
    """A :data:`Fetch` over ``client``: 200 and JSON of at most :data:`MAX_BODY_BYTES`, or
    :class:`ModelInfoError` (``connect``, ``timeout``, ``status_<code>``, ``too_large``, ``malformed``)."""

    async def fetch(url: str) -> Any:
        try:
            async with client.stream("GET", url) as resp:
                if resp.status_code != 200:
                    raise ModelInfoError(f"status_{resp.status_code}")
                body = bytearray()
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_BODY_BYTES:
                        raise ModelInfoError("too_large", f"over {MAX_BODY_BYTES} bytes")
        except httpx.TimeoutException as exc:
            raise ModelInfoError("timeout") from exc
        except httpx.HTTPError as exc:
            raise ModelInfoError("connect", str(exc)[:200]) from exc
        try:
            return json.loads(body)
        except ValueError as exc:
            raise ModelInfoError("malformed", "not JSON") from exc

    return fetch


async def ask(catalog: ModelCatalog, member: Member, fetch: Fetch, clock: Callable[[], float]) -> None:
    """Ask one instance for its models and version; the catalog records the answer or the failure."""
    base = member.url.rstrip("/")
    try:
        models = parse_models(await fetch(base + "/v1/models"))
    except ModelInfoError as exc:
        catalog.failed(member.name, exc.reason)
        log.debug("model info: %s /v1/models failed: %s", member.name, exc)
        return
    version: str | None = None
    try:
        version = parse_version(await fetch(base + "/version"))
    except ModelInfoError as exc:  # the models are still good; the version stays unknown
        catalog.failed(member.name, f"version_{exc.reason}")
    catalog.learnt(member.name, models, version, clock())


async def refresh(
    catalog: ModelCatalog, members: Iterable[Member], fetch: Fetch, clock: Callable[[], float]
) -> None:
    """One round: every member asked at once; the catalog keeps only these members."""
    group = list(members)
    catalog.retain(group)
    await asyncio.gather(*(ask(catalog, m, fetch, clock) for m in group))


async def learn_forever(
    catalog: ModelCatalog,
    members: Callable[[], Iterable[Member]],
    refresh_s: float,
    clock: Callable[[], float] = time.monotonic,
    fetch: Fetch | None = None,
) -> None:
    """:func:`refresh` every ``refresh_s`` until cancelled; each ask bounded by ``min(5, refresh_s)`` s."""
    timeout = min(5.0, refresh_s)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=32)) as client:
        get = fetch or http_fetch(client)
        while True:
            try:
                await asyncio.wait_for(refresh(catalog, members(), get, clock), timeout * 2)
            except TimeoutError:
                log.debug("model info: a round did not finish in %.1fs", timeout * 2)
            await asyncio.sleep(refresh_s)


def members_of(prefill: Iterable[Any], decode: Iterable[Any]) -> list[Member]:
    """The catalog's members from routing targets (anything with ``name`` and ``url``)."""
    out = {t.name: Member(t.name, "prefill", t.url) for t in prefill}
    out.update({t.name: Member(t.name, "decode", t.url) for t in decode})
    return list(out.values())
