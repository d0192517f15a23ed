"""KV events: encoding, dedup, both of vLLM's encodings, and a real ZMQ
subscriber decoding them (with vLLM's own event classes where installed)."""

import time

import msgpack
import pytest
import zmq

from kvoffload.abstractions import Locality, Medium, OffloadingEvent
from kvoffload.config import ConfigError
from kvoffload.events import (
    BlockDescription,
    EventEncoder,
    ZmqEventPublisher,
    decode_batch,
    normalize_event,
    vllm_event_format,
)
from kvoffload.keys import make_offload_key

K = [make_offload_key(bytes([i]) * 8, 0) for i in range(4)]
G1 = make_offload_key(b"\x09" * 8, 1)  # another KV group


def h(key):  # vLLM's default int form of a block hash: the low 64 bits, big-endian
    return int.from_bytes(key[:-4], "big") & (2**64 - 1)


def stored(enc, keys, **kw):
    return [normalize_event(e) for e in enc.encode([OffloadingEvent(keys, Medium.CPU, removed=False, **kw)])]


def test_encoder_dedups_overlapping_stores():
    enc = EventEncoder(block_size=16, event_format="map")
    a = enc.encode([OffloadingEvent(K[:2], Medium.CPU, removed=False)])
    b = enc.encode([OffloadingEvent(K[1:3], Medium.CPU, removed=False)])  # K[1] again
    assert a == [{"type": "BlockStored", "block_hashes": [h(K[0]), h(K[1])], "parent_block_hash": None,
                  "token_ids": [], "block_size": 16, "lora_id": None, "medium": "CPU", "lora_name": None,
                  "group_idx": 0}]
    assert [e["block_hashes"] for e in b] == [[h(K[2])]]


def test_a_remote_store_is_announced_each_time_and_nothing_is_kept_for_it():
    """A remote server evicts without telling us, so no removal ever comes:
    a key stored again (after the server dropped it) must be announced
    again, and the encoder must keep no per-key state for the tier (it grew
    by every key ever stored, for the life of the process)."""
    import tracemalloc

    enc = EventEncoder(block_size=16, event_format="map")
    remote = dict(locality=Locality.REMOTE, ownership="remote")
    assert [e["block_hashes"] for e in stored(enc, K[:2], **remote)] == [[h(K[0]), h(K[1])]]
    assert [e["block_hashes"] for e in stored(enc, K[:2], **remote)] == [[h(K[0]), h(K[1])]]
    many = [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(20_000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(0, len(many), 100):
            enc.encode([OffloadingEvent(many[i:i + 100], Medium.CPU, removed=False, **remote)])
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 100_000  # a set of 20,000 keys alone takes over 500 KB


def test_array_format_is_positional():
    enc = EventEncoder(block_size=16, event_format="array", int_hashes=False)
    out = enc.encode([OffloadingEvent(K[:1], Medium.CPU, removed=False, locality=Locality.LOCAL)])
    assert out == [["BlockStored", [K[0][:-4]], None, [], 16, None, "CPU", None, None, 0, None, None,
                    "LOCAL", None, None]]
    gone = enc.encode([OffloadingEvent(K[:1], Medium.CPU, removed=True, locality=Locality.LOCAL)])
    assert gone == [["BlockRemoved", [K[0][:-4]], "CPU", 0, "LOCAL", None]]
    assert enc.clear() == [["AllBlocksCleared"]]


def test_removed_only_for_announced_and_reannounce_after_removal():
    enc = EventEncoder()
    enc.encode([OffloadingEvent(K[:1], Medium.CPU, removed=False)])
    out = [normalize_event(e) for e in enc.encode([OffloadingEvent(K[:2], Medium.CPU, removed=True)])]
    assert [(e["type"], e["block_hashes"]) for e in out] == [("BlockRemoved", [h(K[0])])]
    again = stored(enc, K[:1])
    assert again and again[0]["type"] == "BlockStored"


def test_failed_store_cleanup_is_not_announced():
    enc = EventEncoder()
    ev = OffloadingEvent(K[:1], Medium.CPU, removed=True, metadata_only=True)  # a failed store's cleanup
    enc.encode([OffloadingEvent(K[:1], Medium.CPU, removed=False)])
    assert enc.encode([ev]) == []
    assert [e["type"] for e in [normalize_event(x) for x in enc.encode(
        [OffloadingEvent(K[:1], Medium.CPU, removed=True)])]] == ["BlockRemoved"]


def test_tiers_are_separate_with_locality_and_ownership():
    enc = EventEncoder()
    out = [normalize_event(e) for e in enc.encode([
        OffloadingEvent(K[:1], Medium.CPU, removed=False),
        OffloadingEvent(K[:1], Medium.STORAGE, removed=False, locality=Locality.LOCAL, ownership="disk"),
        OffloadingEvent(K[:1], Medium.CPU, removed=False, locality=Locality.REMOTE, ownership="redis"),
    ])]
    assert [(e["medium"], e["locality"], e["ownership"]) for e in out] == [
        ("CPU", None, None), ("STORAGE", "LOCAL", "disk"), ("CPU", "REMOTE", "redis")]


def test_one_event_per_kv_group():
    enc = EventEncoder()
    out = stored(enc, [K[0], G1, K[1]])
    assert [(e["group_idx"], e["block_hashes"]) for e in out] == [(0, [h(K[0]), h(K[1])]), (1, [h(G1)])]


def test_self_describing_payload():
    desc = {K[1]: BlockDescription(parent_block_hash=K[0][:-4], token_ids=[1, 2, 3], block_size=3)}
    enc = EventEncoder(block_size=3, describe=desc.get, int_hashes=False)
    out = stored(enc, K[:2])
    assert (out[0]["block_hashes"], out[0]["parent_block_hash"], out[0]["token_ids"]) == ([K[0][:-4]], None, [])
    assert (out[1]["block_hashes"], out[1]["parent_block_hash"], out[1]["token_ids"], out[1]["block_size"]) == (
        [K[1][:-4]], K[0][:-4], [1, 2, 3], 3)


def test_int_hashes_follow_vllms_switch(monkeypatch):
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    assert stored(EventEncoder(), K[:1])[0]["block_hashes"] == [K[0][:-4]]
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES")
    assert stored(EventEncoder(), K[:1])[0]["block_hashes"] == [h(K[0])]


def test_auto_format_is_the_installed_vllms():
    fmt = vllm_event_format()
    assert EventEncoder(event_format="auto").format == (fmt or "map")
    try:
        from vllm.distributed.kv_events import KVCacheEvent
    except ImportError:
        return
    assert fmt == ("array" if KVCacheEvent.__struct_config__.array_like else "map")


def test_bad_format_is_a_clear_error():
    with pytest.raises(ConfigError, match="event format must be one of auto, map, array, got 'json'"):
        ZmqEventPublisher("tcp://127.0.0.1:*", event_format="json")


def _vllm_batch_type(fmt):
    """vLLM's own KVEventBatch; for "array", the same classes (vLLM's fields,
    types, defaults, order) made positional, as vLLM encoded them before."""
    msgspec = pytest.importorskip("msgspec")
    kv = pytest.importorskip("vllm.distributed.kv_events")
    if fmt == "map":
        return kv.KVEventBatch, (kv.BlockStored, kv.BlockRemoved, kv.AllBlocksCleared)
    classes = []
    for cls in (kv.BlockStored, kv.BlockRemoved, kv.AllBlocksCleared):
        fields = [(f.name, f.type) if f.required else (f.name, f.type, f.default)
                  for f in msgspec.structs.fields(cls)]
        classes.append(msgspec.defstruct(cls.__name__, fields, array_like=True, omit_defaults=True, tag=True))
    batch = msgspec.defstruct("KVEventBatch", [("ts", float), ("events", list[classes[0] | classes[1] | classes[2]]),
                                               ("data_parallel_rank", int | None, None)], array_like=True)
    return batch, tuple(classes)


@pytest.mark.parametrize("fmt", ["map", "array"])
def test_zmq_subscriber_decodes_with_vllms_classes(fmt):
    import msgspec

    batch_type, (BlockStored, BlockRemoved, _) = _vllm_batch_type(fmt)
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", topic="kv", data_parallel_rank=0, event_format=fmt)
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
        pub.publish([OffloadingEvent(K[:2], Medium.CPU, removed=False),
                     OffloadingEvent(K[:1], Medium.STORAGE, removed=False, locality=Locality.REMOTE,
                                     ownership="redis"),
                     OffloadingEvent(K[:1], Medium.CPU, removed=True)])
        decoder = msgspec.msgpack.Decoder(batch_type)
        while True:
            topic, seq, payload = sub.recv_multipart()
            batch = decoder.decode(payload)
            if not (len(batch.events) == 1 and type(batch.events[0]).__name__ == "AllBlocksCleared"):
                break
        assert topic == b"kv" and batch.data_parallel_rank == 0 and batch.ts > 0
        assert int.from_bytes(seq, "big") >= 1
        cpu, remote, gone = batch.events
        assert isinstance(cpu, BlockStored) and isinstance(gone, BlockRemoved)
        assert (cpu.block_hashes, cpu.medium, cpu.group_idx, cpu.parent_block_hash) == (
            [h(K[0]), h(K[1])], "CPU", 0, None)
        assert (remote.medium, remote.locality, remote.ownership) == ("STORAGE", "REMOTE", "redis")
        assert (gone.block_hashes, gone.medium, gone.group_idx) == ([h(K[0])], "CPU", 0)
        # what vLLM's classes encode: the same fields, values and order (arrays: vLLM
        # 0.33's classes have one more trailing field, which decodes to its default)
        ours = msgpack.unpackb(payload)[1]
        theirs = msgpack.unpackb(msgspec.msgpack.encode(batch.events))
        if fmt == "map":
            assert [list(e.items()) for e in theirs] == [list(e.items()) for e in ours]
        else:
            assert [e[:len(o)] for e, o in zip(theirs, ours)] == ours
        assert [e["type"] for e in decode_batch(payload)[1]] == ["BlockStored", "BlockStored", "BlockRemoved"]
    finally:
        sub.close()
        pub.close()


def test_bad_endpoint_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot bind KV event endpoint"):
        ZmqEventPublisher("nonsense://x")


from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_KEYS = [make_offload_key(bytes([i]) * 8, i % 2) for i in range(6)]  # two KV groups
_TIERS = [(Medium.CPU, None, None), (Medium.STORAGE, Locality.LOCAL, "disk"),
          (Medium.CPU, Locality.REMOTE, "redis")]
_OPS = st.lists(st.tuples(st.sampled_from(range(3)), st.booleans(), st.booleans(),
                          st.lists(st.sampled_from(range(6)), min_size=1, max_size=6)), max_size=30)


@given(_OPS)
def test_both_encodings_announce_the_same_consistent_stream(ops):
    """Whatever the managers report, a router sees each block stored once
    until removed, removals only of what it was told is stored, one KV group
    per event, and the map and array encodings say the same. A remote tier
    (no removal seen for what its server evicts) is passed through: every
    store and removal as reported, each key once per event."""
    enc = {f: EventEncoder(event_format=f) for f in ("map", "array")}
    held: dict[str, set] = {}
    for tier_i, removed, metadata_only, idx in ops:
        medium, locality, owner = _TIERS[tier_i]
        ev = OffloadingEvent([_KEYS[i] for i in idx], medium, removed=removed, locality=locality,
                             ownership=owner, metadata_only=removed and metadata_only)
        out = {f: [normalize_event(e) for e in e_.encode([ev])] for f, e_ in enc.items()}
        assert out["map"] == out["array"]
        tier = held.setdefault(str(tier_i), set())
        for e in out["map"]:
            assert (e["medium"], e["locality"], e["ownership"]) == (medium.value, locality and locality.value,
                                                                     owner)
            keys = {k for k in _KEYS if h(k) in e["block_hashes"] and k[-1] == e["group_idx"]}
            assert len(keys) == len(e["block_hashes"])  # one group per event, no repeats
            if locality is Locality.REMOTE:
                assert (e["type"] == "BlockRemoved") == removed and not ev.metadata_only
                continue
            if e["type"] == "BlockStored":
                assert not removed and not tier & keys
                tier |= keys
            else:
                assert removed and not ev.metadata_only and keys <= tier
                tier -= keys
        if locality is Locality.REMOTE:
            if not ev.metadata_only:  # every key of it, once
                assert sum(len(e["block_hashes"]) for e in out["map"]) == len(set(ev.keys))
        elif removed and not ev.metadata_only:
            assert not tier & set(ev.keys)  # everything it held of them is now announced removed
        elif not removed:
            assert set(ev.keys) <= tier
