"""A simulated engine's KV block pool with prefix caching, as vLLM V1's block pool behaves.

Blocks hold ``block_size`` tokens each. A full block of a prompt is named by a chain hash: a
digest of its parent's hash and its own tokens (the first block's seeded with its LoRA
adapter's name), so the same tokens after the same prefix get the same hash in every process.
A block that a request fills is *cached* under its hash; a request that starts with the same
tokens reuses it (its reference count goes up) instead of computing it again.

Like vLLM: a block whose last reference is dropped stays cached (reference count 0, on the free
queue) until an allocation needs it; allocations take free blocks from the head of the queue
(least recently freed first) and evict the hash of a cached one they take (``BlockRemoved``). A
request frees its blocks last block first, so the tail of a chain, the least shared part, goes
before its head. A new request's hit is the longest run of its full blocks found from the first,
capped so that at least one prompt token is computed (vLLM always computes the last one). A
shrunken capacity (a KV fault) evicts cached free blocks until active + cached fits.

Everything the pool does to the cache is appended to ``events`` (pdscope.kvevents values), for
the engine to publish. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pdscope.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, Event, chain_digest, chained

MEDIUM = "GPU"
_ROOT = b"pdscope-sim-block-root\0"


def chain_hash(parent: int | None, tokens: Sequence[int], lora: str | None = None) -> int:
    """The hash of one full block: 63 bits of blake2b over the parent's hash and the tokens."""
    digest = chain_digest(
        None if parent is None else parent.to_bytes(8, "big"), tokens, lora, root=_ROOT, size=8
    )
    return int.from_bytes(digest, "big") >> 1  # non-negative, fits msgpack's int64 too


def block_hashes(token_ids: Sequence[int], block_size: int, lora: str | None = None) -> list[int]:
    """The chain hash of every full block of ``token_ids``, first block first."""
    return chained(token_ids, block_size, lambda parent, tokens: chain_hash(parent, tokens, lora))


def hit_cap_blocks(num_tokens: int, block_size: int) -> int:
    """The most blocks a request of ``num_tokens`` may take from the cache: at least one token computed."""
    return max(0, num_tokens - 1) // block_size


class BlockPool:
    """``num_blocks`` physical blocks; which are in use, which cached, in what LRU order."""

    def __init__(self, num_blocks: int, block_size: int, *, caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._hash_of: dict[int, int] = {}  # block -> its hash (cached blocks only)
        self._by_hash: dict[int, int] = {}  # hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with refcount 0, LRU first
        self.events: list[Event] = []
        self._removed: list[int] = []
        self.evicted = 0

    # -- reads ----------------------------------------------------------------------------

    @property
    def active(self) -> int:
        """Blocks some request (or lease) holds: what vLLM's KV usage counts."""
        return self.num_blocks - len(self._free)

    @property
    def cached(self) -> int:
        return len(self._by_hash)

    @property
    def cached_free(self) -> int:
        return len(self._evictable)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def match(self, hashes: Sequence[int], num_tokens: int) -> list[int]:
        """The cached blocks of the longest cached run of ``hashes`` from the first, capped so that
        at least one of the request's ``num_tokens`` is left to compute."""
        if not self.caching:
            return []
        out: list[int] = []
        for h in hashes[: hit_cap_blocks(num_tokens, self.block_size)]:
            block = self._by_hash.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def revived(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` are free now (taking them makes them active)."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    # -- changes --------------------------------------------------------------------------

    def touch(self, blocks: Sequence[int]) -> None:
        """A request reuses these cached blocks: one more reference each."""
        for b in blocks:
            if self._refs[b] == 0:
                self._free.pop(b, None)
                self._evictable.pop(b, None)
            self._refs[b] += 1

    def allocate(self, n: int, capacity: int) -> list[int] | None:
        """``n`` fresh blocks, evicting cached free ones as needed; None when active + n > capacity."""
        if n <= 0:
            return []
        if self.active + n > min(capacity, self.num_blocks):
            return None
        out: list[int] = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            if b in self._hash_of:
                self._evictable.pop(b, None)
                self._evict(b)
            self._refs[b] = 1
            out.append(b)
        self.shrink_to(capacity)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block, last first; blocks left unreferenced join the tail of
        the free queue (still cached, if they were)."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] <= 0:
                self._refs[b] = 0
                self._free[b] = None
                if b in self._hash_of:
                    self._evictable[b] = None

    def cache(
        self, blocks: Sequence[int], hashes: Sequence[int], token_ids: Sequence[int], first: int, last: int
    ) -> None:
        """Blocks ``first..last-1`` of a request (``blocks``, ``hashes`` by position) are now full: cache
        them under their hashes, one ``BlockStored`` for the run. A hash another block already holds is
        left to that block (this one stays uncached), as is a block already cached."""
        if not self.caching or last <= first:
            return
        run_hashes: list[int] = []
        run_start = first
        for i in range(first, last):
            b, h = blocks[i], hashes[i]
            if b in self._hash_of or h in self._by_hash:
                self._stored(run_hashes, run_start, hashes, token_ids)
                run_hashes, run_start = [], i + 1
                continue
            self._hash_of[b] = h
            self._by_hash[h] = b
            run_hashes.append(h)
        self._stored(run_hashes, run_start, hashes, token_ids)

    def _stored(self, run: list[int], start: int, hashes: Sequence[int], token_ids: Sequence[int]) -> None:
        if not run:
            return
        bs = self.block_size
        self._flush_removed()
        self.events.append(
            BlockStored(
                block_hashes=tuple(run),
                parent=hashes[start - 1] if start > 0 else None,
                token_ids=tuple(token_ids[start * bs : (start + len(run)) * bs]),
                block_size=bs,
                lora_name=None,
                medium=MEDIUM,
            )
        )

    def shrink_to(self, capacity: int) -> int:
        """Evict least recently used cached free blocks until active + cached-free fits ``capacity``."""
        n = 0
        while self._evictable and self.active + len(self._evictable) > capacity:
            b, _ = self._evictable.popitem(last=False)
            self._evict(b)
            n += 1
        return n

    def _evict(self, b: int) -> None:
        h = self._hash_of.pop(b)
        del self._by_hash[h]
        self.evicted += 1
        self._removed.append(h)  # one BlockRemoved per run of evictions

    def _flush_removed(self) -> None:
        if self._removed:
            self.events.append(BlockRemoved(tuple(self._removed), MEDIUM))
            self._removed = []

    def clear(self) -> None:
        """Forget every cached hash (a restart, a reset): ``AllBlocksCleared``. References are kept."""
        self._hash_of.clear()
        self._by_hash.clear()
        self._evictable.clear()
        self._removed = []  # cleared anyway
        self.events.append(AllBlocksCleared())

    def take_events(self) -> list[Event]:
        self._flush_removed()
        out, self.events = self.events, []
        return out
