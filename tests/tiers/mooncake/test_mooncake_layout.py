"""The Mooncake value layout: one buffer per key, the chunk then its 48-byte
header in the host-pool slot's trailer room. The trailer stays inside its
slot (real bytes of the neighbours checked), a pool without the room is
refused, and the tiered spec asks for the room when a mooncake tier is
configured. (A value of the old header-first layout is a counted miss:
test_mooncake_corrupt.py, "header_first".)"""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.config import OffloadingConfig
from kvoffload.replay.engine import EngineOptions, replay
from kvoffload.replay.generator import generate_chat
from kvoffload.spec import build_spec
from kvoffload.tiers.base import ALIGN, Namespace
from kvoffload.tiers.host_pool import HostPool, SharedHostPool
from kvoffload.tiers.mooncake import MooncakeTier
from kvoffload.tiers.remote.value import HEADER, HEADER_BYTES, MAGIC
from mooncake_helpers import PATIENT, fill, keys_for, load, make_tier, store

pytestmark = pytest.mark.mooncake


@pytest.mark.parametrize("chunk, stride", [(4096, 2 * ALIGN), (4000, ALIGN), (ALIGN - HEADER_BYTES + 2, 2 * ALIGN)])
def test_host_pool_trailer_room(chunk, stride):
    pool = HostPool(3, chunk, trailer_bytes=HEADER_BYTES)
    try:
        assert pool.chunk_bytes == stride and pool.used_chunk_bytes == chunk
        assert pool.chunk_bytes - chunk >= HEADER_BYTES and pool.chunk_bytes % ALIGN == 0
    finally:
        pool.close()
    with pytest.raises(ValueError, match="trailer_bytes"):
        HostPool(3, chunk, trailer_bytes=-1)


def test_shared_pool_ranks_must_agree_on_the_trailer(tmp_path):
    made = SharedHostPool.create(tmp_path / "pool", 2, 4096, trailer_bytes=HEADER_BYTES)
    try:
        with pytest.raises(ValueError, match="disagree"):
            SharedHostPool.open(tmp_path / "pool", 2, 4096)  # another slot stride: wrong bytes, refused
        same = SharedHostPool.open(tmp_path / "pool", 2, 4096, trailer_bytes=HEADER_BYTES)
        assert same.chunk_bytes == made.chunk_bytes == 2 * ALIGN
        same.close()
    finally:
        made.close()


@pytest.mark.parametrize("chunk", [8192, 8000])  # trailer in an extra page / in the 4 KiB padding
def test_trailer_stays_in_its_slot(mooncake, prefix, chunk):
    tier, m, w, pool = make_tier(mooncake, prefix, num_chunks=6, chunk_bytes=chunk)
    try:
        keys = keys_for(2, seed=31)
        pool.array[:] = 0xA5  # every byte of every slot, padding included
        fill(pool, [0, 2], seed=31)
        around = pool.array[[1, 3]].copy()
        assert store(m, w, keys, [0, 2])
        for s, k in zip([0, 2], keys):  # the header went right after the chunk, in slot s
            magic, _, _, length, _, _, _ = HEADER.unpack(pool.array[s, chunk:chunk + HEADER_BYTES].tobytes())
            assert magic == MAGIC and length == chunk
            assert (pool.array[s, chunk + HEADER_BYTES:] == 0xA5).all()
        assert np.array_equal(pool.array[[1, 3]], around)  # the slots after them untouched
        pool.array[4] = 0
        pool.array[5] = 0x5A
        assert load(m, w, [keys[1]], [4])
        assert np.array_equal(pool.array[4, :chunk], pool.array[2, :chunk])
        assert np.array_equal(pool.array[4, :chunk + HEADER_BYTES], pool.array[2, :chunk + HEADER_BYTES])
        assert (pool.array[4, chunk + HEADER_BYTES:] == 0).all() and (pool.array[5] == 0x5A).all()
    finally:
        tier.shutdown()


def test_pool_without_trailer_room_is_refused(mooncake, prefix):
    pool = HostPool(4, 8192)  # 8192-byte chunks fill their 4 KiB-aligned slots
    tier = MooncakeTier(mooncake.tier_config(key_prefix=prefix, segment_bytes=0, **PATIENT),
                        Namespace(model="tiny", chunk_bytes=8192))
    try:
        with pytest.raises(ValueError, match=f"trailer_bytes={HEADER_BYTES}"):
            tier.get_worker(pool)
    finally:
        tier.shutdown()
        pool.close()


def test_tiered_spec_reserves_the_trailer_only_for_mooncake(mooncake, prefix, tmp_path):
    def spec_of(tiers):
        return build_spec("tiered", OffloadingConfig.from_dict({"extra_config": {
            "kv_bytes_per_chunk": 8192, "num_cpu_chunks": 8, "secondary_tiers": tiers}}))

    storage = {"type": "storage", "path": str(tmp_path / "kv"), "capacity_bytes": 1 << 20}
    plain = spec_of([storage])
    assert plain.cpu.pool_trailer_bytes == 0
    plain.get_manager().shutdown()
    both = spec_of([dict(storage, path=str(tmp_path / "kv2")),
                    {"type": "mooncake", "key_prefix": prefix, "segment_bytes": 0, **mooncake.tier_config(),
                     **PATIENT}])
    try:
        assert both.cpu.pool_trailer_bytes == HEADER_BYTES
        assert both.get_manager().tiers[0].backend.store.slot_bytes == 8192  # the files' format: unchanged
    finally:
        both.get_manager().shutdown()


def test_storage_and_mooncake_tiers_share_the_pool(mooncake, prefix, tmp_path):
    """Both tiers on the trailer-room pool (storage reads and writes the first slot_bytes of each
    slot): every loaded block verified."""
    trace = generate_chat(seed=5, sessions=4, block_size=64)
    res = replay(trace, EngineOptions(spec="tiered", progress=False, extra_config={
        "num_cpu_chunks": 32,
        "secondary_tiers": [
            {"type": "storage", "path": str(tmp_path / "kv"), "capacity_bytes": 64 << 20},
            {"type": "mooncake", "key_prefix": prefix, "max_queue_depth": 1 << 16, "segment_bytes": 0,
             **mooncake.tier_config(), **PATIENT}]}))
    assert res.tiers["mooncake"]["counters"]["stored_blocks"] > 0
    assert res.tiers["storage"]["counters"].get("stored_blocks", 0) > 0
    assert res.counters["verify_failures"] == 0 and res.counters["verified_blocks"] > 0
