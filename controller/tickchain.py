"""Tick records as keyframes and deltas: which a tick writes, and how a run of them is read back whole.

A keyframe holds a tick's whole record (the document :mod:`controller.ticklog` builds, encoded by a
:class:`Codec` and compressed), as every record of format 1 did. A delta holds only how the record
differs from the one before it (:func:`controller.treediff.diff` of the two documents) with two
checksums: ``base``, of the document it was taken against, and ``sum``, of the document it rebuilds
(CRC-32 of the document's encoding). Records are written in MessagePack (:data:`WRITTEN`: a float in
9 bytes, where JSON spends up to 24 characters on its shortest exact decimal, and a quarter of the
compressed size less at 1,000 instances); those written in compact JSON by an older pdscope still
read (:data:`CODECS`, by the record's ``codec`` column). One writer writes one codec, and a chain
starts at each writer's first record, so a chain is in one codec.

A record is a keyframe every ``every``-th tick, and whenever the record before it is not the same
leader epoch's tick before (a start, a restart, a takeover, a tick that failed after it was encoded,
any gap) or was decided under another policy config or version.

Reading (:class:`Rebuilder`) starts from a keyframe and applies each delta in turn; a delta whose
base is not the record before it (a tick missing from the epoch, a keyframe deleted) or that does not
rebuild its ``sum`` raises :class:`ChainError`, so a record is never replayed as something else.
The writer checks each delta before it stores it, and stores the whole record (a keyframe) where the
delta would not rebuild it: it encodes the document once (its checksum, or the keyframe), and compares
the rebuilt document's encoding with those bytes, the very test a reader's checksum makes.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import msgpack

from controller.treediff import Differ, PatchError, patch

LEVEL = 6  # zlib


class ChainError(ValueError):
    """A delta cannot be rebuilt into the record it was written for."""


@dataclass(frozen=True)
class Link:
    """Where a record sits in its chain: the tick, its leader epoch and the config it ran under."""

    epoch: int | None
    tick: int
    policy: str
    policy_version: int

    def follows(self, prev: Link) -> bool:
        """Whether this record may be a delta on ``prev``: the same epoch's next tick, same config."""
        return (
            prev.epoch == self.epoch
            and prev.tick + 1 == self.tick
            and (prev.policy, prev.policy_version) == (self.policy, self.policy_version)
        )


def text(doc: Any) -> bytes:
    """``doc`` as compact JSON (the codec of records written before MessagePack)."""
    return json.dumps(doc, separators=(",", ":")).encode()


def _packed(doc: Any) -> bytes:
    return msgpack.packb(doc, use_bin_type=True)  # type: ignore[no-any-return]


def _unpacked(raw: bytes) -> Any:
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except msgpack.UnpackException as exc:  # the ones that are not ValueErrors already
        raise ValueError(f"not MessagePack: {exc}") from None


@dataclass(frozen=True)
class Codec:
    """How a record's document is turned into bytes before compression, and back: exact for every JSON
    value (a float's bits, a str, an int, a list, a dict's keys in order)."""

    name: str  # the record's ``codec`` column
    encode: Callable[[Any], bytes]
    decode: Callable[[bytes], Any]


JSON_ZLIB: Final = Codec("json+zlib", text, json.loads)
MSGPACK_ZLIB: Final = Codec("msgpack+zlib", _packed, _unpacked)
CODECS: Final = {c.name: c for c in (JSON_ZLIB, MSGPACK_ZLIB)}
WRITTEN: Final = MSGPACK_ZLIB  # what this pdscope writes


def checksum(raw: bytes) -> int:
    return zlib.crc32(raw)


@dataclass(frozen=True)
class Written:
    """A record as it goes into the store: its payload and whether it is a keyframe."""

    payload: bytes
    keyframe: bool


class ChainWriter:
    """Chooses keyframe or delta for each record, keeping the last record's document."""

    def __init__(self, every: int, codec: Codec = WRITTEN) -> None:
        if every < 1:
            raise ValueError("a keyframe every tick at least")
        self.every = every
        self.codec = codec
        self._last: tuple[Link, Any, int] | None = None  # the link, the document, its checksum
        self._since_key = 0  # records since the last keyframe
        self._differ = Differ()  # knows the last document's lists

    def write(self, link: Link, doc: Any) -> Written:
        raw = self.codec.encode(doc)
        crc = checksum(raw)
        last = self._last
        self._last = (link, doc, crc)
        delta = None
        if last is not None and link.follows(last[0]) and self._since_key + 1 < self.every:
            delta = self._checked_delta(self._differ.diff(last[1], doc), last[1], last[2], raw, crc)
        else:
            self._differ = Differ()
        if delta is None:
            self._since_key = 0
            return Written(zlib.compress(raw, LEVEL), keyframe=True)
        self._since_key += 1
        return Written(zlib.compress(self.codec.encode(delta), LEVEL), keyframe=False)

    def _checked_delta(
        self, node: Any, base: Any, base_crc: int, raw: bytes, crc: int
    ) -> dict[str, Any] | None:
        """The delta ``node`` on ``base`` as stored, or None where its patch does not rebuild the document
        encoded ``raw`` (of checksum ``crc``) byte for byte: a change :func:`controller.treediff.diff` does
        not see (a zero's sign, a reordered dict, an int for a float), which a reader's checksum would
        refuse."""
        if self.codec.encode(patch(base, node)) != raw:
            return None
        return {"base": base_crc, "sum": crc, "delta": node}


def keyframe_doc(payload: bytes, codec: Codec = WRITTEN) -> tuple[dict[str, Any], int]:
    """A keyframe's document and checksum; raises ``zlib.error``, ``ValueError``."""
    raw = zlib.decompress(payload)
    doc = codec.decode(raw)
    if not isinstance(doc, dict):
        raise ValueError("not an object")
    return doc, checksum(raw)


class Rebuilder:
    """Rebuilds the documents of consecutive records of one read, oldest first."""

    def __init__(self) -> None:
        self._last: tuple[Link, Any, int] | None = None

    def keyframe(self, link: Link, payload: bytes, codec: Codec = WRITTEN) -> dict[str, Any]:
        doc, crc = keyframe_doc(payload, codec)
        self._last = (link, doc, crc)
        return doc

    def delta(self, link: Link, payload: bytes, codec: Codec = WRITTEN) -> dict[str, Any]:
        """The document a delta rebuilds; :class:`ChainError` when the record before it is not its base."""
        last = self._last
        self._last = None  # a failed delta breaks the chain for the records after it too
        if last is None:
            raise ChainError("no record before it in the store to rebuild it from: its keyframe is gone")
        if not link.follows(last[0]):
            raise ChainError(
                f"the record before it is tick {last[0].tick} of epoch {last[0].epoch}: "
                f"tick {link.tick - 1} of epoch {link.epoch} is missing"
            )
        body = codec.decode(zlib.decompress(payload))
        if not isinstance(body, dict) or body.get("base") != last[2]:
            raise ChainError(f"it was taken against another record than the stored tick {last[0].tick}")
        try:
            doc = patch(last[1], body.get("delta"))
        except (PatchError, KeyError, IndexError, TypeError) as exc:
            raise ChainError(f"it does not apply to the record before it: {exc}") from None
        crc = checksum(codec.encode(doc))
        if crc != body.get("sum") or not isinstance(doc, dict):
            raise ChainError("it does not rebuild the record it was written for (checksum differs)")
        self._last = (link, doc, crc)
        return doc
