"""The prefix index: which instance holds which prompt prefix, keyed by tokens, bounded."""

from __future__ import annotations

from pdscope.kvevents import AllBlocksCleared, Batch, BlockRemoved, BlockStored
from proxy.kvindex import PrefixIndex, chain_keys

BS = 4
PROMPT = list(range(1000, 1016))  # four blocks


def stored(
    hashes: list[int | bytes], tokens: list[int], parent: int | bytes | None = None, lora: str | None = None
) -> Batch:
    return Batch(1.0, (BlockStored(tuple(hashes), parent, tuple(tokens), BS, lora),))


def test_a_stored_chain_is_matched_by_its_tokens_whatever_vllms_hashes() -> None:
    idx = PrefixIndex(BS, 1000)
    idx.apply("p0", stored([1, 2, 3], PROMPT[:12]))  # int hashes
    idx.apply("p1", stored([b"\xaa", b"\xbb"], PROMPT[:8]))  # bytes hashes, a shorter prefix
    keys = chain_keys(PROMPT, BS)
    assert len(keys) == 4
    assert idx.match(keys) == {"p0": 12, "p1": 8}
    assert idx.match(keys, ["p0", "p1", "p2"]) == {"p0": 12, "p1": 8, "p2": 0}
    other = chain_keys([7, 7, 7, 7, *PROMPT[4:]], BS)  # differs in the first block: nothing cached
    assert idx.match(other) == {}


def test_a_chain_continued_in_a_later_event_by_its_parent_hash() -> None:
    idx = PrefixIndex(BS, 1000)
    idx.apply("p0", stored([1], PROMPT[:4]))
    idx.apply("p0", stored([2, 3], PROMPT[4:12], parent=1))
    assert idx.match(chain_keys(PROMPT, BS)) == {"p0": 12}


def test_an_unknown_parent_is_an_orphan_not_a_guess() -> None:
    idx = PrefixIndex(BS, 1000)
    got = idx.apply("p0", stored([2], PROMPT[4:8], parent=99))
    assert got.orphans == 1 and idx.orphans == 1 and len(idx) == 0


def test_the_adapter_is_part_of_the_key() -> None:
    idx = PrefixIndex(BS, 1000)
    idx.apply("p0", stored([1], PROMPT[:4], lora="sql-lora"))
    assert idx.match(chain_keys(PROMPT, BS)) == {}
    assert idx.match(chain_keys(PROMPT, BS, lora="sql-lora")) == {"p0": 4}


def test_removal_and_clearing() -> None:
    idx = PrefixIndex(BS, 1000)
    idx.apply("p0", stored([1, 2, 3], PROMPT[:12]))
    idx.apply("p1", stored([1, 2], PROMPT[:8]))
    got = idx.apply("p0", Batch(2.0, (BlockRemoved((2, 77)),)))
    assert (got.removed, got.unknown_removed) == (1, 1)
    assert idx.match(chain_keys(PROMPT, BS)) == {"p0": 4, "p1": 8}  # p0's chain is broken after block 1
    got = idx.apply("p1", Batch(3.0, (AllBlocksCleared(),)))
    assert got.cleared == 2 and idx.blocks("p1") == 0
    assert idx.match(chain_keys(PROMPT, BS)) == {"p0": 4}


def test_the_same_tokens_under_two_hashes_stay_until_both_are_removed() -> None:
    idx = PrefixIndex(BS, 1000)
    idx.apply("p0", stored([1], PROMPT[:4]))
    idx.apply("p0", stored([b"\x01"], PROMPT[:4]))  # e.g. the copy offloaded to CPU
    idx.apply("p0", Batch(1.0, (BlockRemoved((1,)),)))
    assert idx.match(chain_keys(PROMPT, BS)) == {"p0": 4}
    idx.apply("p0", Batch(1.0, (BlockRemoved((b"\x01",)),)))
    assert idx.match(chain_keys(PROMPT, BS)) == {}


def test_the_fleet_wide_budget_evicts_the_least_recently_stored() -> None:
    idx = PrefixIndex(BS, 3)
    idx.apply("p0", stored([1, 2], PROMPT[:8]))
    idx.apply("p1", stored([1, 2], PROMPT[:8]))  # 4 entries: p0's first block goes
    assert len(idx) == 3 and idx.evicted == 1
    assert idx.match(chain_keys(PROMPT, BS)) == {"p1": 8}


def test_a_stale_instance_gets_no_credit_until_rebuilt() -> None:
    idx = PrefixIndex(BS, 1000)
    idx.apply("p0", stored([1, 2], PROMPT[:8]))
    idx.apply("p1", stored([1], PROMPT[:4]))
    idx.mark_stale("p0")
    assert idx.match(chain_keys(PROMPT, BS)) == {"p1": 4}
    idx.clear("p0")
    assert "p0" not in idx.stale and idx.blocks("p0") == 0


def test_another_block_size_is_not_indexed() -> None:
    idx = PrefixIndex(BS, 1000)
    got = idx.apply("p0", Batch(1.0, (BlockStored((1,), None, tuple(range(8)), 8),)))
    assert got.wrong_block_size == 1 and len(idx) == 0


def test_chain_keys_cover_full_blocks_only() -> None:
    assert len(chain_keys(list(range(15)), BS)) == 3
    assert chain_keys([], BS) == []
    assert (
        chain_keys(PROMPT, BS)[:2] == chain_keys(PROMPT[:9], BS)[:2]
    )  # a prefix's keys are the prefix of the keys


def test_blocks_stored_after_a_clear_in_the_same_batch_count() -> None:
    idx = PrefixIndex(BS, 1000)
    idx.apply("p0", stored([1], PROMPT[:4]))
    batch = Batch(2.0, (AllBlocksCleared(), BlockStored((5,), None, tuple(PROMPT[:4]), BS)))
    assert idx.apply("p0", batch).cleared == 1
    assert idx.blocks("p0") == 1 and idx.match(chain_keys(PROMPT, BS)) == {"p0": 4}


def test_an_instance_flooding_the_index_evicts_its_own_entries_not_others() -> None:
    """The fleet-wide bound takes from the instance holding the most (was: the least recently
    stored fleet-wide, so a flood of forged blocks from one instance evicted every other's)."""
    idx = PrefixIndex(BS, 10)
    idx.apply("p0", stored([1, 2], PROMPT[:8]))
    for i in range(100):  # one instance stores 100 unrelated blocks
        idx.apply("p1", Batch(1.0, (BlockStored((1000 + i,), None, (9000 + i,) * BS, BS),)))
    assert idx.blocks("p0") == 2 and idx.blocks("p1") == 8 and len(idx) == 10
    assert idx.match(chain_keys(PROMPT, BS))["p0"] == 8 and idx.evicted == 92


def test_a_distrusted_instance_gets_no_credit_and_a_rebuild_does_not_end_it() -> None:
    idx = PrefixIndex(BS, 1000)
    idx.apply("p0", stored([1, 2], PROMPT[:8]))
    idx.distrusted = {"p0"}
    assert idx.match(chain_keys(PROMPT, BS)) == {} and "p0" in idx.stale
    idx.clear("p0")
    idx.apply("p0", stored([1, 2], PROMPT[:8]))
    assert idx.match(chain_keys(PROMPT, BS)) == {}
    idx.distrusted = set()
    assert idx.match(chain_keys(PROMPT, BS)) == {"p0": 8}
