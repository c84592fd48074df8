"""The simulated block pool with prefix caching: tables of allocations, frees and matches."""

from __future__ import annotations

import pytest

from pdscope.kvevents import AllBlocksCleared, BlockRemoved, BlockStored
from simulator.prefixcache import BlockPool, block_hashes, chain_hash, hit_cap_blocks

BS = 4


def ids(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def compute(pool: BlockPool, tokens: list[int], capacity: int | None = None) -> list[int]:
    """A request that computes ``tokens`` from scratch (after its hit) and caches its full blocks."""
    hashes = block_hashes(tokens, BS)
    hit = pool.match(hashes, len(tokens))
    pool.touch(hit)
    n_blocks = -(-len(tokens) // BS)
    fresh = pool.allocate(n_blocks - len(hit), capacity if capacity is not None else pool.num_blocks)
    assert fresh is not None
    blocks = hit + fresh
    pool.cache(blocks, hashes, tokens, len(hit), len(hashes))
    return blocks


def test_chain_hash_depends_on_parent_tokens_and_lora() -> None:
    a = chain_hash(None, [1, 2, 3, 4])
    assert a == chain_hash(None, [1, 2, 3, 4])  # deterministic (no per-process salt)
    assert a != chain_hash(None, [1, 2, 3, 5])
    assert a != chain_hash(None, [1, 2, 3, 4], "adapter")
    assert chain_hash(a, [5, 6, 7, 8]) != chain_hash(None, [5, 6, 7, 8])
    assert 0 <= a < 2**63
    assert block_hashes(ids(11), BS) == [
        chain_hash(None, ids(4)),
        chain_hash(chain_hash(None, ids(4)), ids(4, 104)),
    ]


@pytest.mark.parametrize(
    ("num_tokens", "cap"),
    [(0, 0), (1, 0), (4, 0), (5, 1), (8, 1), (9, 2), (12, 2), (13, 3)],
)
def test_hit_cap_leaves_at_least_one_token(num_tokens: int, cap: int) -> None:
    assert hit_cap_blocks(num_tokens, BS) == cap


@pytest.mark.parametrize(
    ("cached", "query", "hit_blocks"),
    [
        (ids(12), ids(13), 3),  # the whole cached prefix
        (ids(12), ids(12), 2),  # all cached, but the last token must be computed: one block less
        (ids(12), ids(9), 2),  # a shorter prompt: its own full blocks only
        (ids(12), ids(6), 1),
        (ids(12), [*ids(8), 1, 2, 3, 4, 5], 2),  # diverges in block 3: partial hit
        (ids(12), [7, *ids(12)[1:], 1], 0),  # differs in the first token: no hit at all
        (ids(3), ids(20), 0),  # nothing full was cached
        ([], ids(20), 0),
    ],
)
def test_match_is_the_longest_cached_run(cached: list[int], query: list[int], hit_blocks: int) -> None:
    pool = BlockPool(32, BS)
    if cached:
        pool.free(compute(pool, cached))
    assert len(pool.match(block_hashes(query, BS), len(query))) == hit_blocks


def test_hit_reuses_blocks_and_counts_references() -> None:
    pool = BlockPool(16, BS)
    first = compute(pool, ids(9))  # 3 blocks, 2 full ones cached
    assert pool.active == 3 and pool.cached == 2
    second = compute(pool, ids(9))  # shares the 2 cached blocks, allocates 1
    assert second[:2] == first[:2] and second[2] != first[2]
    assert [pool.refcount(b) for b in first[:2]] == [2, 2] and pool.active == 4
    pool.free(first)
    assert [pool.refcount(b) for b in first[:2]] == [1, 1] and pool.active == 3
    pool.free(second)
    assert pool.active == 0 and pool.cached == 2 and pool.cached_free == 2  # freed, still cached


def test_freed_cached_blocks_survive_until_an_allocation_needs_them() -> None:
    pool = BlockPool(4, BS)
    pool.free(compute(pool, ids(8)))  # 2 blocks cached, free
    assert len(pool.match(block_hashes(ids(9), BS), 9)) == 2
    pool.take_events()
    got = pool.allocate(2, 4)  # the 2 never-used blocks go first
    assert got is not None and pool.cached == 2 and pool.take_events() == []
    pool.free(got)  # freed after the cached ones: the cached blocks are now least recently used
    got = pool.allocate(1, 4)
    assert got is not None and pool.cached == 1
    hashes = block_hashes(ids(8), BS)
    assert pool.take_events() == [BlockRemoved((hashes[1],), "GPU")]  # the chain's tail went first


def test_eviction_takes_the_tail_of_a_chain_first() -> None:
    pool = BlockPool(3, BS)
    tokens = ids(12)
    hashes = block_hashes(tokens, BS)
    pool.free(compute(pool, tokens))  # freed last block first: the head stays longest
    pool.take_events()
    assert pool.allocate(1, 3) is not None
    (removed,) = pool.take_events()
    assert removed == BlockRemoved((hashes[2],), "GPU")
    assert len(pool.match(block_hashes(ids(13), BS), 13)) == 2  # the head of the chain still hits


def test_small_capacity_drops_the_hit() -> None:
    """Two prompts that do not fit together: each evicts the other, so repeats stop hitting."""
    a, b = ids(8), ids(8, start=500)
    pool = BlockPool(2, BS)
    hits = []
    for prompt in (a, b, a, b):
        hits.append(len(pool.match(block_hashes([*prompt, 1], BS), 9)))
        pool.free(compute(pool, prompt))
    assert hits == [0, 0, 0, 0]
    roomy = BlockPool(4, BS)
    hits = []
    for prompt in (a, b, a, b):
        hits.append(len(roomy.match(block_hashes([*prompt, 1], BS), 9)))
        roomy.free(compute(roomy, prompt))
    assert hits == [0, 0, 2, 2]


def test_allocate_refuses_past_capacity_and_shrink_evicts_cached_free_blocks() -> None:
    pool = BlockPool(8, BS)
    pool.free(compute(pool, ids(16)))  # 4 cached free blocks
    held = pool.allocate(2, 8)
    assert held is not None and pool.active == 2
    assert pool.allocate(7, 8) is None  # active + 7 > 8: refused, nothing changes
    assert pool.active == 2 and pool.cached == 4
    pool.take_events()
    assert pool.shrink_to(4) == 2  # a capacity cut: active 2 + cached 2 fit in 4
    assert pool.cached == 2 and pool.active == 2
    (removed,) = pool.take_events()
    assert isinstance(removed, BlockRemoved) and len(removed.block_hashes) == 2


def test_stored_events_carry_tokens_parent_and_block_size() -> None:
    pool = BlockPool(8, BS)
    tokens = ids(10)
    hashes = block_hashes(tokens, BS)
    blocks = pool.allocate(3, 8)
    assert blocks is not None
    pool.cache(blocks, hashes, tokens, 0, 1)  # the first block fills
    pool.cache(blocks, hashes, tokens, 1, 2)  # then the second
    first, second = pool.take_events()
    assert first == BlockStored((hashes[0],), None, tuple(tokens[:4]), BS, None, "GPU")
    assert second == BlockStored((hashes[1],), hashes[0], tuple(tokens[4:8]), BS, None, "GPU")


def test_a_hash_already_held_stays_with_its_block() -> None:
    """Two requests computing the same prefix at once: the second's copy stays uncached."""
    pool = BlockPool(8, BS)
    tokens = ids(8)
    hashes = block_hashes(tokens, BS)
    a, b = pool.allocate(2, 8), pool.allocate(2, 8)
    assert a is not None and b is not None
    pool.cache(a, hashes, tokens, 0, 2)
    pool.cache(b, hashes, tokens, 0, 2)
    assert len(pool.take_events()) == 1 and pool.cached == 2
    assert not pool.is_cached(b[0])


def test_clear_forgets_every_hash() -> None:
    pool = BlockPool(8, BS)
    held = compute(pool, ids(8))
    pool.take_events()
    pool.clear()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.cached == 0 and pool.match(block_hashes(ids(9), BS), 9) == []
    pool.free(held)
    assert pool.active == 0


def test_caching_off_never_hits_or_stores() -> None:
    pool = BlockPool(8, BS, caching=False)
    pool.free(compute(pool, ids(8)))
    assert pool.match(block_hashes(ids(9), BS), 9) == [] and pool.cached == 0 and pool.take_events() == []
