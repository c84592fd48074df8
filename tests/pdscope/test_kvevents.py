"""vLLM's KV events on the wire: both encodings, both hash forms, and whatever else arrives."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdscope.kvevents import (
    AllBlocksCleared,
    BadMessage,
    Batch,
    BlockRemoved,
    BlockStored,
    SeqTracker,
    decode_batch,
    decode_message,
    encode_batch,
    encode_message,
)

TOKENS = list(range(100, 132))  # two blocks of 16


def test_an_array_like_batch_as_vllm_packs_it() -> None:
    # written by hand in vLLM's layout (tag first, fields in declaration order, trailing defaults omitted)
    payload = msgpack.packb(
        [
            1765000000.5,
            [
                ["BlockStored", [11, 12], None, TOKENS, 16, None, "GPU"],
                ["BlockStored", [b"\x01" * 32], 12, list(range(16)), 16, None, "GPU", "my-lora"],
                ["BlockRemoved", [11], "GPU"],
                ["AllBlocksCleared"],
            ],
            0,
        ],
        use_bin_type=True,
    )
    b = decode_batch(payload)
    assert b.ts == 1765000000.5 and b.dp_rank == 0 and b.skipped == 0
    assert b.events[0] == BlockStored((11, 12), None, tuple(TOKENS), 16, None, "GPU")
    assert b.events[1] == BlockStored((b"\x01" * 32,), 12, tuple(range(16)), 16, "my-lora", "GPU")
    assert b.events[2] == BlockRemoved((11,), "GPU")
    assert b.events[3] == AllBlocksCleared()


def test_a_tagged_map_batch() -> None:
    payload = msgpack.packb(
        {
            "ts": 5.0,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [b"\xaa"],
                    "token_ids": list(range(16)),
                    "block_size": 16,
                },
                {"type": "BlockRemoved", "block_hashes": [b"\xaa"]},
            ],
        },
        use_bin_type=True,
    )
    b = decode_batch(payload)
    assert b.events == (BlockStored((b"\xaa",), None, tuple(range(16)), 16), BlockRemoved((b"\xaa",)))
    assert b.dp_rank is None


@pytest.mark.parametrize("encoding", ["array", "map", "vllm"])
def test_encode_then_decode_is_the_same_batch(encoding: str) -> None:
    batch = Batch(
        3.25,
        (
            BlockStored((1, 2), None, tuple(TOKENS), 16, "a", "GPU"),
            BlockStored((b"\x02",), 2, tuple(range(16)), 16),
            BlockRemoved((1,), "CPU"),
            AllBlocksCleared(),
        ),
        dp_rank=1,
    )
    assert decode_batch(encode_batch(batch, encoding)) == batch  # type: ignore[arg-type]
    msg = decode_message(encode_message("kv", 41, batch, encoding))  # type: ignore[arg-type]
    assert (msg.topic, msg.seq, msg.batch) == ("kv", 41, batch)


def test_the_vllm_encoding_is_an_array_batch_of_tagged_map_events() -> None:
    """vLLM 0.32: ``EventBatch`` is array_like, ``KVCacheEvent`` tag=True (maps); omit_defaults
    leaves out only fields that have a default, so the ones without are sent even when null."""
    batch = Batch(2.0, (BlockStored((7,), None, tuple(range(16)), 16), AllBlocksCleared()), dp_rank=0)
    raw = msgpack.unpackb(encode_batch(batch, "vllm"), raw=False)
    assert raw[0] == 2.0 and raw[2] == 0
    stored, cleared = raw[1]
    assert stored == {
        "type": "BlockStored",
        "block_hashes": [7],
        "parent_block_hash": None,
        "token_ids": list(range(16)),
        "block_size": 16,
        "lora_id": None,
        "medium": None,
        "lora_name": None,
    }
    assert cleared == {"type": "AllBlocksCleared"}


@pytest.mark.parametrize(
    "event",
    [
        ["BlockSwapped", [1]],  # a type this version does not know
        ["BlockStored", [1, 2], None, list(range(16)), 16],  # tokens fill one block of two
        ["BlockStored", [1], None, list(range(16)), 0],  # no block size
        ["BlockStored", [True], None, list(range(16)), 16],  # a bool is not a hash
        ["BlockStored", [1], None, [-1] * 16, 16],  # a negative token
        ["BlockStored", [1], None, ["a"] * 16, 16],
        ["BlockRemoved", "not-a-list"],
        ["BlockRemoved", list(range(65_537))],  # more hashes than one event may carry
        ["BlockStored", [1], None, list(range(4097)), 4097],  # a block over 4,096 tokens
        {"no": "type"},
        42,
    ],
)
def test_a_bad_event_is_skipped_and_counted_the_rest_kept(event: object) -> None:
    good = ["BlockRemoved", [7]]
    b = decode_batch(msgpack.packb([1.0, [event, good]], use_bin_type=True))
    assert b.skipped == 1 and b.events == (BlockRemoved((7,)),)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1", "msgpack"),  # a byte msgpack never uses
        (msgpack.packb([1.0, [["BlockRemoved", [1]]]])[:-3], "msgpack"),  # truncated
        (msgpack.packb("hello"), "shape"),
        (msgpack.packb([float("nan"), []]), "shape"),
        (msgpack.packb([1.0, "events"]), "shape"),
        (b"\x00" * (16 * 2**20 + 1), "size"),
        (msgpack.packb([1.0, [42] * 100_001]), "size"),  # more events than one batch may carry
    ],
)
def test_an_unreadable_batch_is_a_bad_message_with_its_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(BadMessage) as err:
        decode_batch(payload)
    assert err.value.reason == reason


def test_frames_and_seq_are_checked() -> None:
    with pytest.raises(BadMessage, match="frames"):
        decode_message([b"kv", b"\x00" * 8])
    with pytest.raises(BadMessage, match="seq"):
        decode_message([b"kv", b"\x01", encode_batch(Batch(1.0, ()))])


@given(st.binary(max_size=512))
def test_any_bytes_decode_or_raise_bad_message_only(data: bytes) -> None:
    try:
        decode_batch(data)
    except BadMessage:
        pass


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text() | st.binary(),
        lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
        max_leaves=30,
    )
)
def test_any_msgpack_value_decodes_or_raises_bad_message_only(value: object) -> None:
    try:
        decode_batch(msgpack.packb([1.0, [value]], use_bin_type=True))
        decode_batch(msgpack.packb(value, use_bin_type=True))
    except BadMessage:
        pass


def test_seq_tracker_sees_gaps_restarts_and_duplicates() -> None:
    t = SeqTracker()
    assert [t.see(s) for s in (5, 6, 7)] == ["ok", "ok", "ok"]
    assert t.see(10) == "gap" and t.missed == 2 and t.gaps == [(8, 9)]
    assert t.see(10) == "duplicate" and t.expected == 11
    assert t.see(0) == "restart" and t.restarts == 1
    assert t.see(1) == "ok"


def test_the_payload_bound_is_the_callers_when_lower() -> None:
    payload = msgpack.packb([1.0, [["BlockRemoved", [1]]] * 100])
    assert len(decode_batch(payload).events) == 100
    with pytest.raises(BadMessage) as err:
        decode_batch(payload, max_bytes=len(payload) - 1)
    assert err.value.reason == "size"
