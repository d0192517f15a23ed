"""Persistence on real files: restart in a new process, corrupted bytes,
another namespace (kill -9 rounds: test_storage_crash.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvoffload.abstractions import LookupResult
from kvoffload.tiers.base import Namespace
from kvoffload.tiers.storage.tier import StorageTier
from storage_helpers import CHUNK, CTX, NS, close, expected, fill, key, load, store

HERE = os.path.dirname(__file__)

WRITER = f"""
import sys
sys.path.insert(0, {HERE!r})
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.storage.tier import StorageTier
from storage_helpers import CHUNK, NS, close, fill, key, store
tier = StorageTier(sys.argv[1], 32 * CHUNK, CHUNK, NS)
pool = HostPool(4, CHUNK)
keys = [key(i) for i in range(100, 104)]
for c, k in enumerate(keys):
    fill(pool, c, k)
assert store(tier, pool, keys, [0, 1, 2, 3])
close(tier)
"""


@pytest.mark.slow
def test_restart_in_a_new_process_hits(tmp_path, make_tier, pool):
    path = tmp_path / "store"
    subprocess.run([sys.executable, "-c", WRITER, str(path)], check=True, timeout=120)
    tier = make_tier(path=path)
    mgr = tier.get_manager()
    keys = [key(i) for i in range(100, 104)]
    assert [mgr.lookup(k, CTX) for k in keys] == [LookupResult.HIT] * 4
    assert load(tier, pool, keys, [4, 5, 6, 7])
    for c, k in enumerate(keys):
        np.testing.assert_array_equal(pool.chunk(4 + c), expected(k))


def test_other_namespace_is_never_served(tmp_path, make_tier, pool):
    tier = make_tier()
    fill(pool, 0, key(1))
    assert store(tier, pool, [key(1)], [0])
    close(tier)
    other = make_tier(namespace=Namespace(model="other-model", dtype="float16", chunk_bytes=CHUNK))
    assert other.get_manager().lookup(key(1), CTX) is LookupResult.MISS
    close(other)
    same = make_tier()
    assert same.get_manager().lookup(key(1), CTX) is LookupResult.HIT


def test_flipped_byte_is_a_miss_and_counted(make_tier, pool):
    tier = make_tier()
    keys = [key(i) for i in range(3)]
    for c, k in enumerate(keys):
        fill(pool, c, k)
    assert store(tier, pool, keys, [0, 1, 2])
    mgr = tier.get_manager()
    slot = mgr._slot_of[keys[1]]
    fd, off = tier.store.locate(slot)
    # flip one byte behind the tier's back, through an ordinary buffered fd
    path = tier.store.dir / f"slab-{slot % tier.store.num_files}.bin"
    with open(path, "r+b") as f:
        f.seek(off + 1234)
        b = f.read(1)
        f.seek(off + 1234)
        f.write(bytes([b[0] ^ 0x40]))
        f.flush()
        os.fsync(f.fileno())
    assert not load(tier, pool, [keys[1]], [5])
    assert mgr.lookup(keys[1], CTX) is LookupResult.MISS
    assert mgr.get_stats().counters["checksum_failures"] == 1
    assert load(tier, pool, [keys[0], keys[2]], [6, 7])  # the others still serve
    np.testing.assert_array_equal(pool.chunk(7), expected(keys[2]))
    close(tier)
    again = make_tier()  # the corrupt block stays gone after a restart
    assert again.get_manager().lookup(keys[1], CTX) is LookupResult.MISS
