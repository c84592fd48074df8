"""Which instance holds which prompt prefix in its KV cache, from vLLM's own KV events.

vLLM names a cached block by a hash of its own (an int or bytes, depending on version and
``--prefix-caching-hash-algo``); pdscope does not depend on that algorithm. A ``BlockStored``
event carries the block's token ids and its parent's hash, so the index keys every block by
a chain key of its own: a digest of the parent's chain key and the block's tokens, the first
block's seeded with its LoRA adapter's name. Two instances holding the same tokens under the
same adapter hold the same chain keys, and a request's prompt, cut into blocks of the fleet's
block size, is matched by computing the same keys (:func:`chain_keys`).

Bounded: at most ``max_blocks`` (instance, block) entries fleet-wide; past that the instance
holding the most entries loses its least recently stored one (counted in ``evicted``), so an
instance that floods the index with blocks evicts its own entries, never those of an instance
holding fewer: each keeps at least its fair share (``max_blocks`` over the publishing instances).
A block whose parent the index does not know (evicted, or stored before the subscriber started)
cannot be keyed and is counted in ``orphans``; so is a removal of a block it never saw
(``unknown_removed``). An instance marked stale (a gap in its event stream, being replayed) keeps
its entries but :meth:`PrefixIndex.match` credits it nothing until it is unmarked, or cleared and
rebuilt; an instance marked distrusted (its predicted hits did not come true: ``proxy.kvtrust``)
is credited nothing until it is trusted again, whatever its events say, and a rebuild does not
end that. Pure: no I/O, no clock; one thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdscope.kvevents import (
    AllBlocksCleared,
    Batch,
    BlockHash,
    BlockRemoved,
    BlockStored,
    chain_digest,
    chained,
)

ChainKey = bytes
_ROOT = b"pdscope-kv-root\0"


def _key(parent: ChainKey | None, tokens: Sequence[int], lora: str | None) -> ChainKey:
    return chain_digest(parent, tokens, lora, root=_ROOT, size=16)


def chain_keys(token_ids: Sequence[int], block_size: int, lora: str | None = None) -> list[ChainKey]:
    """The chain key of every full block of a prompt, first block first."""
    return chained(token_ids, block_size, lambda parent, tokens: _key(parent, tokens, lora))


@dataclass
class Applied:
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    orphans: int = 0
    unknown_removed: int = 0
    wrong_block_size: int = 0


class PrefixIndex:
    def __init__(self, block_size: int, max_blocks: int) -> None:
        if block_size <= 0 or max_blocks <= 0:
            raise ValueError("block_size and max_blocks must be positive")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._by_hash: dict[str, dict[BlockHash, ChainKey]] = {}  # instance -> vLLM hash -> chain key
        self._holders: dict[ChainKey, set[str]] = {}
        self._refs: dict[tuple[str, ChainKey], int] = {}  # (instance, chain key) -> its vLLM hashes
        # per instance, its blocks' store stamps, least recently stored first
        self._lru: dict[str, OrderedDict[BlockHash, int]] = {}
        self._size = 0
        self._stamp = 0
        self._stale: set[str] = set()
        self.distrusted: set[str] = set()
        self.evicted = 0
        self.orphans = 0
        self.unknown_removed = 0

    # -- events -------------------------------------------------------------------------

    def apply(self, instance: str, batch: Batch) -> Applied:
        out = Applied()
        blocks = self._by_hash.setdefault(instance, {})
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(instance, blocks, ev, out)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    if self._drop(instance, blocks, h):
                        out.removed += 1
                    else:
                        out.unknown_removed += 1
            elif isinstance(ev, AllBlocksCleared):
                out.cleared += self.clear(instance)
                blocks = self._by_hash.setdefault(instance, {})
        self.orphans += out.orphans
        self.unknown_removed += out.unknown_removed
        self._bound()
        return out

    def _stored(
        self, instance: str, blocks: dict[BlockHash, ChainKey], ev: BlockStored, out: Applied
    ) -> None:
        if ev.block_size != self.block_size:
            out.wrong_block_size += 1
            return
        if ev.parent is None:
            parent = None
        else:
            parent = blocks.get(ev.parent)
            if parent is None:
                out.orphans += len(ev.block_hashes)
                return
        for i, h in enumerate(ev.block_hashes):
            key = _key(parent, ev.token_ids[i * self.block_size : (i + 1) * self.block_size], ev.lora_name)
            old = blocks.get(h)
            if old != key:
                if old is not None:
                    self._drop(instance, blocks, h)
                blocks[h] = key
                ref = (instance, key)
                self._refs[ref] = self._refs.get(ref, 0) + 1
                self._holders.setdefault(key, set()).add(instance)
            self._touch(instance, h)
            parent = key
            out.stored += 1

    def _touch(self, instance: str, h: BlockHash) -> None:
        lru = self._lru.setdefault(instance, OrderedDict())
        if h not in lru:
            self._size += 1
        self._stamp += 1
        lru[h] = self._stamp
        lru.move_to_end(h)

    def _drop(self, instance: str, blocks: dict[BlockHash, ChainKey], h: BlockHash) -> bool:
        key = blocks.pop(h, None)
        if key is None:
            return False
        lru = self._lru.get(instance)
        if lru is not None and lru.pop(h, None) is not None:
            self._size -= 1
        ref = (instance, key)
        left = self._refs.get(ref, 1) - 1  # the same tokens under two of vLLM's hashes (two media)
        if left > 0:
            self._refs[ref] = left
            return True
        self._refs.pop(ref, None)
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(instance)
            if not holders:
                del self._holders[key]
        return True

    def _bound(self) -> None:
        while self._size > self.max_blocks:
            instance = self._largest()
            h = next(iter(self._lru[instance]))
            if self._drop(instance, self._by_hash.get(instance, {}), h):
                self.evicted += 1
            else:  # not indexed under that hash (cannot happen): the stamp goes anyway
                del self._lru[instance][h]
                self._size -= 1

    def _largest(self) -> str:
        """The instance holding the most entries (of those, the one whose oldest is oldest)."""
        return max(
            (inst for inst, lru in self._lru.items() if lru),
            key=lambda inst: (len(self._lru[inst]), -next(iter(self._lru[inst].values()))),
        )

    def clear(self, instance: str) -> int:
        """Forget everything ``instance`` holds (it cleared its cache, restarted, or its view went
        stale and is being rebuilt). Returns the blocks forgotten; the instance is no longer stale."""
        blocks = self._by_hash.pop(instance, {})
        n = len(blocks)
        for h in list(blocks):
            self._drop(instance, blocks, h)
        self._lru.pop(instance, None)
        self._stale.discard(instance)
        return n

    @property
    def stale(self) -> frozenset[str]:
        """The instances credited nothing now: stale (being replayed) or distrusted."""
        return frozenset(self._stale | self.distrusted)

    def mark_stale(self, instance: str) -> None:
        self._stale.add(instance)

    def unmark_stale(self, instance: str) -> None:
        """Its gap was replayed: its view is whole again (a distrust stays)."""
        self._stale.discard(instance)

    # -- reads --------------------------------------------------------------------------

    def blocks(self, instance: str) -> int:
        return len(self._by_hash.get(instance, {}))

    def __len__(self) -> int:
        return self._size

    def match(self, keys: Sequence[ChainKey], instances: Iterable[str] | None = None) -> dict[str, int]:
        """Cached prompt tokens per instance: the longest run of ``keys`` from the first that it holds,
        times the block size. Stale instances (and those not in ``instances``, when given) get 0."""
        wanted = None if instances is None else set(instances)
        depth: dict[str, int] = {}
        live: set[str] | None = None
        for i, key in enumerate(keys):
            holders = self._holders.get(key)
            if not holders:
                break
            live = set(holders) if live is None else live & holders
            live -= self._stale
            live -= self.distrusted
            if wanted is not None:
                live &= wanted
            if not live:
                break
            for inst in live:
                depth[inst] = i + 1
        out = {inst: n * self.block_size for inst, n in depth.items()}
        if wanted is not None:
            for inst in wanted:
                out.setdefault(inst, 0)
        return out
