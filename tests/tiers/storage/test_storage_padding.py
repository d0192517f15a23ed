"""A chunk that is not a multiple of 4 KiB leaves padding in its storage
slot, and another tier may write there while this one stores the slot (the
Mooncake tier keeps its value header right after the chunk). The storage
tier's checksum covers the chunk, not the padding, so such a write never
turns a good block into a miss."""

from __future__ import annotations

import os

import numpy as np

from kvoffload.abstractions import LookupResult
from kvoffload.tiers.base import Namespace, align_up
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.storage import worker as storage_worker
from kvoffload.tiers.storage.tier import StorageTier
from storage_helpers import CTX, close, key, load, store

ODD = 16 * 1024 - 100  # leaves 100 bytes of padding in a 16 KiB slot
NS = Namespace(model="test-model", dtype="float16", layout="test", block_size=16, chunk_bytes=ODD)


def test_a_write_into_the_padding_during_a_store_keeps_the_block(tmp_path, monkeypatch):
    pool = HostPool(8, ODD, trailer_bytes=48)
    tier = StorageTier(str(tmp_path / "store"), 8 * align_up(ODD), align_up(ODD), NS)
    try:
        keys = [key(i) for i in range(4)]
        rng = np.random.default_rng(0)
        want = [rng.integers(0, 256, ODD, dtype=np.uint8) for _ in keys]
        for c, w in enumerate(want):
            pool.chunk(c)[:ODD] = w
        real = os.pwritev

        def scribble(fd, bufs, off):  # the other tier writes its trailer after the checksum was taken
            for b in bufs:
                b[ODD:] = b"\xab" * (len(b) - ODD)
            return real(fd, bufs, off)

        monkeypatch.setattr(storage_worker.os, "pwritev", scribble)
        assert store(tier, pool, keys, [0, 1, 2, 3])
        monkeypatch.undo()
        assert all(tier.get_manager().lookup(k, CTX) == LookupResult.HIT for k in keys)
        assert load(tier, pool, keys, [4, 5, 6, 7])
        for c, w in enumerate(want):
            np.testing.assert_array_equal(pool.chunk(4 + c)[:ODD], w)
    finally:
        close(tier)
        pool.close()
