"""The KV events publisher on its own: never blocks, bounded ring, replay, bad binds."""

from __future__ import annotations

import pytest
import zmq

from pdscope.config import ConfigError
from pdscope.kvevents import AllBlocksCleared, BlockRemoved, decode_batch
from pdscope.simconfig import SimulatorConfig
from simulator.fleet import Fleet, InstanceSpec
from simulator.kvpublish import KvEventPublisher

ANY = "tcp://127.0.0.1:*"


def test_publishing_without_subscribers_never_blocks_and_the_ring_is_bounded() -> None:
    pub = KvEventPublisher(ANY, None, "t", buffer_steps=50, hwm=10, clock=lambda: 12.5)
    try:
        for i in range(2000):  # far past the high-water mark: PUB drops, publish returns
            pub.publish([BlockRemoved((i,), "GPU")])
        assert pub.seq == 2000 and pub.sent + pub.dropped == 2000
        kept = pub.replay_from(0)
        assert [s for s, _ in kept] == list(range(1950, 2000))  # the newest 50
        batch = decode_batch(kept[-1][1])
        assert batch.ts == 12.5 and batch.events == (BlockRemoved((1999,), "GPU"),) and batch.dp_rank == 0
        pub.publish([])  # nothing to say: no message, no seq
        assert pub.seq == 2000
    finally:
        pub.close()
    assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith("*")


def test_a_closed_publisher_counts_drops_instead_of_raising() -> None:
    pub = KvEventPublisher(ANY)
    pub.close()
    pub.publish([AllBlocksCleared()])
    assert pub.dropped == 1 and pub.sent == 0


def test_an_endpoint_in_use_is_a_config_error_naming_the_instance() -> None:
    first = KvEventPublisher(ANY)
    try:
        with pytest.raises(zmq.ZMQError):
            KvEventPublisher(first.endpoint)
        with pytest.raises(ConfigError, match="decode-0: kv_events_endpoint"):
            Fleet(
                [
                    InstanceSpec("prefill", "prefill-0", kv_events_endpoint=ANY),
                    InstanceSpec("decode", "decode-0", kv_events_endpoint=first.endpoint),
                ],
                model_name="m",
                kv_bytes_per_token=1024,
                cfg=SimulatorConfig(),
            )
    finally:
        first.close()


def test_prefix_caching_can_be_turned_off_per_instance() -> None:
    cfg = SimulatorConfig(instances={"decode-1": {"prefix_caching": False}})
    assert cfg.prefix_caching and not cfg.for_instance("decode-1").prefix_caching
