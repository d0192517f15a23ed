"""KV events: encoding, dedup, and a real ZMQ subscriber decoding them."""

import time

import msgpack
import pytest
import zmq

from kvoffload.abstractions import Locality, Medium, OffloadingEvent
from kvoffload.events import BlockDescription, EventEncoder, ZmqEventPublisher, decode_batch
from kvoffload.keys import make_offload_key

K = [make_offload_key(bytes([i]) * 8, 0) for i in range(4)]


def test_encoder_dedups_overlapping_stores():
    enc = EventEncoder(block_size=16)
    a = enc.encode([OffloadingEvent(K[:2], Medium.CPU, removed=False)])
    b = enc.encode([OffloadingEvent(K[1:3], Medium.CPU, removed=False)])  # K[1] again
    assert a == [["BlockStored", [K[0][:-4], K[1][:-4]], None, [], 16, None, "CPU"]]
    assert b == [["BlockStored", [K[2][:-4]], None, [], 16, None, "CPU"]]


def test_removed_only_for_announced_and_reannounce_after_removal():
    enc = EventEncoder()
    enc.encode([OffloadingEvent(K[:1], Medium.CPU, removed=False)])
    out = enc.encode([OffloadingEvent(K[:2], Medium.CPU, removed=True)])
    assert out == [["BlockRemoved", [K[0][:-4]], "CPU"]]
    again = enc.encode([OffloadingEvent(K[:1], Medium.CPU, removed=False)])
    assert again and again[0][0] == "BlockStored"


def test_tiers_are_separate_and_remote_medium_label():
    enc = EventEncoder()
    out = enc.encode([
        OffloadingEvent(K[:1], Medium.CPU, removed=False),
        OffloadingEvent(K[:1], Medium.STORAGE, removed=False, locality=Locality.LOCAL, ownership="disk"),
        OffloadingEvent(K[:1], Medium.CPU, removed=False, locality=Locality.REMOTE, ownership="redis"),
    ])
    assert [e[-1] for e in out] == ["CPU", "STORAGE", "CPU_REMOTE"]


def test_self_describing_payload():
    desc = {K[1]: BlockDescription(parent_block_hash=K[0][:-4], token_ids=[1, 2, 3], block_size=3)}
    enc = EventEncoder(block_size=3, describe=desc.get)
    out = enc.encode([OffloadingEvent(K[:2], Medium.CPU, removed=False)])
    assert out[0] == ["BlockStored", [K[0][:-4]], None, [], 3, None, "CPU"]
    assert out[1] == ["BlockStored", [K[1][:-4]], K[0][:-4], [1, 2, 3], 3, None, "CPU"]


def test_zmq_subscriber_receives_vllm_format():
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", topic="kv", data_parallel_rank=0)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.RCVTIMEO, 120_000)  # generous: a loaded machine delays ZMQ's I/O threads
    sub.connect(pub.endpoint)
    try:
        # PUB/SUB drops messages until the subscription propagates: send until one arrives.
        deadline = time.monotonic() + 120
        got = None
        while got is None and time.monotonic() < deadline:
            pub.publish_cleared()
            try:
                got = sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                time.sleep(0.05)
        assert got is not None
        pub.publish([OffloadingEvent(K[:2], Medium.CPU, removed=False)])
        while True:
            topic, seq, payload = sub.recv_multipart()
            ts, events, rank = decode_batch(payload)
            if events[0][0] != "AllBlocksCleared":
                break
        assert topic == b"kv" and rank == 0 and ts > 0
        assert int.from_bytes(seq, "big") >= 1
        assert events == [["BlockStored", [K[0][:-4], K[1][:-4]], None, [], 0, None, "CPU"]]
        assert msgpack.unpackb(payload)[1][0][0] == "BlockStored"
    finally:
        sub.close()
        pub.close()


def test_bad_endpoint_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot bind KV event endpoint"):
        ZmqEventPublisher("nonsense://x")
