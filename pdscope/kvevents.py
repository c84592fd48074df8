"""vLLM's KV cache events on the wire: one ZMQ message decoded (and encoded, for the simulator).

vLLM (``--kv-events-config`` with ``"publisher": "zmq"``) publishes on a PUB socket. A message
is three frames: ``[topic, seq, payload]`` -- ``seq`` 8 bytes big-endian, counting messages,
``payload`` a msgpack ``EventBatch``. The batch and its events are msgspec structs, encoded in
one of two ways vLLM has used:

- **array-like** (older vLLM): a batch is ``[ts, events, data_parallel_rank]``, an event
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, ...]`` (the tag first, then the fields in declaration order; trailing defaults
  omitted, fields after ``lora_name`` ignored here), ``["BlockRemoved", block_hashes, medium,
  ...]``, ``["AllBlocksCleared"]``;
- **tagged maps**: ``{"ts", "events", "data_parallel_rank"}``, an event ``{"type": "BlockStored",
  "block_hashes": ..., ...}``;
- and the two mixed, as vLLM 0.32 publishes (``EventBatch`` is ``array_like``, ``KVCacheEvent`` is
  ``tag=True`` without it): an array-like batch of tagged-map events. Events are decoded one by
  one, so any mix reads; the simulator publishes this one (``encoding="vllm"``), which is also
  what vLLM's own Rust router (``vllm-router``) accepts.

A block hash is an int or bytes (vLLM has sent both); it names a block only within one
instance's stream, so pdscope keys cached prefixes by token ids instead (``BlockStored``
carries them). Everything here is bounded: the payload size, the number of events, hashes and
tokens. A message that cannot be read raises :class:`BadMessage` with a short ``reason`` for
the drop counter; an event of an unknown type, or one whose fields do not fit, is skipped and
counted in :attr:`Batch.skipped` (a bad event costs only itself).
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import msgpack

BlockHash = int | bytes

MAX_PAYLOAD_BYTES = 16 * 2**20
MAX_EVENTS = 100_000
MAX_BLOCKS_PER_EVENT = 65_536
MAX_TOKENS_PER_EVENT = 4 * 2**20
MAX_BLOCK_SIZE = 4096
MAX_HASH_BYTES = 64
END_SEQ = -1  # the replay socket's end of stream

_K = TypeVar("_K")


def chain_digest(
    parent: bytes | None, tokens: Sequence[int], lora: str | None, *, root: bytes, size: int
) -> bytes:
    """The ``size``-byte blake2b digest naming one full block by its tokens after its prefix: over the
    parent block's digest (a first block's: ``root`` and its LoRA adapter's name), then the tokens.
    The scheme of the proxy's prefix index (``proxy.kvindex``) and the simulator's block pool."""
    h = hashlib.blake2b(digest_size=size)
    h.update(parent if parent is not None else root + (lora or "").encode() + b"\0")
    h.update(array("I", tokens).tobytes())
    return h.digest()


def chained(
    token_ids: Sequence[int], block_size: int, link: Callable[[_K | None, Sequence[int]], _K]
) -> list[_K]:
    """The key of every full block of ``token_ids``, first block first: ``link(parent's key, tokens)``."""
    keys: list[_K] = []
    parent: _K | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = link(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


class BadMessage(ValueError):
    """A message that cannot be read; ``reason`` labels the drop (frames, seq, size, msgpack, shape)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None = None
    skipped: int = 0  # events of an unknown type, or whose fields do not fit


@dataclass(frozen=True, slots=True)
class Message:
    topic: str
    seq: int
    batch: Batch


class _BadEvent(ValueError):
    pass


# -- decoding -----------------------------------------------------------------------------


def decode_message(frames: Sequence[bytes], max_bytes: int = MAX_PAYLOAD_BYTES) -> Message:
    """One PUB message (``[topic, seq, payload]``). Raises BadMessage."""
    if len(frames) != 3:
        raise BadMessage("frames", f"expected [topic, seq, payload], got {len(frames)} frame(s)")
    topic, seq, payload = frames
    return Message(topic.decode("utf-8", "replace")[:256], decode_seq(seq), decode_batch(payload, max_bytes))


def decode_seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise BadMessage("seq", f"expected 8 bytes, got {len(raw)}")
    return int.from_bytes(raw, "big", signed=True)


def decode_batch(payload: bytes, max_bytes: int = MAX_PAYLOAD_BYTES) -> Batch:
    """A msgpack ``EventBatch`` in either encoding, of at most ``max_bytes``. Raises BadMessage.

    The subscriber's sockets refuse a larger message before reading it (ZMQ ``MAXMSGSIZE``); this
    check is the second line, for a payload that came another way (a replay, a test)."""
    limit = min(max_bytes, MAX_PAYLOAD_BYTES)
    if len(payload) > limit:
        raise BadMessage("size", f"payload of {len(payload)} bytes (limit {limit})")
    try:
        obj = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=False,
            max_array_len=MAX_TOKENS_PER_EVENT,
            max_map_len=4096,
            max_str_len=1 << 16,
            max_bin_len=1 << 16,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise BadMessage("msgpack", str(exc)[:200]) from exc
    if isinstance(obj, list | tuple) and len(obj) >= 2:
        ts, events, rank = obj[0], obj[1], obj[2] if len(obj) > 2 else None
    elif isinstance(obj, dict) and "events" in obj:
        ts, events, rank = obj.get("ts"), obj["events"], obj.get("data_parallel_rank")
    else:
        raise BadMessage("shape", f"not an EventBatch: {type(obj).__name__}")
    if not _finite(ts) or not isinstance(events, list | tuple):
        raise BadMessage("shape", "EventBatch needs a finite ts and a list of events")
    if len(events) > MAX_EVENTS:
        raise BadMessage("size", f"{len(events)} events in one batch (limit {MAX_EVENTS})")
    out: list[Event] = []
    skipped = 0
    for raw in events:
        try:
            ev = _event(raw)
        except _BadEvent:
            skipped += 1
            continue
        out.append(ev)
    dp = rank if isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < 65536 else None
    return Batch(float(ts), tuple(out), dp, skipped)


def _event(raw: Any) -> Event:
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        tag, fields = raw[0], list(raw[1:])
        names = _ORDER.get(tag)
        if names is None:
            raise _BadEvent(tag)
        get = dict(zip(names, fields, strict=False)).get
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        tag, get = raw["type"], raw.get
    else:
        raise _BadEvent("untagged")
    if tag == "BlockStored":
        hashes = _hashes(get("block_hashes"))
        tokens = _tokens(get("token_ids"))
        size = get("block_size")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= MAX_BLOCK_SIZE:
            raise _BadEvent("block_size")
        if len(tokens) != len(hashes) * size:
            raise _BadEvent("token_ids do not fill the blocks")
        parent = get("parent_block_hash")
        return BlockStored(
            hashes,
            None if parent is None else _hash(parent),
            tokens,
            size,
            _opt_str(get("lora_name")),
            _opt_str(get("medium")),
        )
    if tag == "BlockRemoved":
        return BlockRemoved(_hashes(get("block_hashes")), _opt_str(get("medium")))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise _BadEvent(tag)


# Field order of each event's array-like encoding (after the tag), as vLLM declares them.
_ORDER: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _hash(v: Any) -> BlockHash:
    if isinstance(v, bool):
        raise _BadEvent("hash")
    if isinstance(v, int):
        return v
    if isinstance(v, bytes) and 0 < len(v) <= MAX_HASH_BYTES:
        return v
    raise _BadEvent("hash")


def _hashes(v: Any) -> tuple[BlockHash, ...]:
    if not isinstance(v, list | tuple) or len(v) > MAX_BLOCKS_PER_EVENT:
        raise _BadEvent("block_hashes")
    return tuple(_hash(h) for h in v)


def _tokens(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list | tuple) or len(v) > MAX_TOKENS_PER_EVENT:
        raise _BadEvent("token_ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in v):
        raise _BadEvent("token_ids")
    return tuple(v)


def _opt_str(v: Any) -> str | None:
    return v[:256] if isinstance(v, str) and v else None


# -- encoding (the simulator's publisher; tests) ------------------------------------------------

Encoding = Literal["array", "map", "vllm"]  # vllm: an array-like batch of tagged-map events


def encode_batch(batch: Batch, encoding: Encoding = "array") -> bytes:
    """``batch`` as vLLM would publish it, in either encoding."""
    events = [_encode_event(e, encoding) for e in batch.events]
    if encoding == "map":  # "vllm" keeps the array-like batch
        obj: Any = {"ts": batch.ts, "events": events, "data_parallel_rank": batch.dp_rank}
    else:
        obj = [batch.ts, events, batch.dp_rank]
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


def encode_message(topic: str, seq: int, batch: Batch, encoding: Encoding = "array") -> list[bytes]:
    return [topic.encode(), seq.to_bytes(8, "big", signed=True), encode_batch(batch, encoding)]


def _encode_event(e: Event, encoding: Encoding) -> Any:
    fields: dict[str, Any]
    if isinstance(e, BlockStored):
        tag = "BlockStored"
        fields = {
            "block_hashes": list(e.block_hashes),
            "parent_block_hash": e.parent,
            "token_ids": list(e.token_ids),
            "block_size": e.block_size,
            "lora_id": None,
            "medium": e.medium,
            "lora_name": e.lora_name,
        }
    elif isinstance(e, BlockRemoved):
        tag, fields = "BlockRemoved", {"block_hashes": list(e.block_hashes), "medium": e.medium}
    else:
        tag, fields = "AllBlocksCleared", {}
    if encoding == "map":
        return {"type": tag, **{k: v for k, v in fields.items() if v is not None}}
    if encoding == "vllm":  # msgspec omit_defaults: fields without a default are sent even when null
        return {"type": tag, **fields}
    values = [fields[name] for name in _ORDER[tag]]
    while values and values[-1] is None:  # omit_defaults: trailing defaults are left out
        values.pop()
    return [tag, *values]


@dataclass
class SeqTracker:
    """Gaps in one publisher's sequence: the next ``seq`` expected, what was missed."""

    expected: int | None = None
    missed: int = 0
    restarts: int = 0
    gaps: list[tuple[int, int]] = field(default_factory=list)  # the last few (first missing, last missing)

    def see(self, seq: int) -> Literal["ok", "gap", "restart", "duplicate"]:
        """``gap``: messages were missed (replay them or mark the view stale); ``restart``: the
        publisher counts from a lower number (it restarted: its cache is new too)."""
        exp, self.expected = self.expected, seq + 1
        if exp is None or seq == exp:
            return "ok"
        if seq > exp:
            self.missed += seq - exp
            self.gaps = [*self.gaps[-7:], (exp, seq - 1)]
            return "gap"
        if seq == exp - 1:
            self.expected = exp
            return "duplicate"
        self.restarts += 1
        return "restart"
