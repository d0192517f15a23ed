import os
import stat

import numpy as np
import pytest

from kvoffload.abstractions import LookupResult
from storage_helpers import CHUNK, CTX, close, expected, fill, key, load, store


@pytest.mark.parametrize("direct_io", [True, False])
def test_round_trip_bit_exact(make_tier, pool, direct_io):
    tier = make_tier(direct_io=direct_io)
    assert tier.store.direct_io is direct_io
    keys = [key(i) for i in range(8)]
    for c, k in enumerate(keys):
        fill(pool, c, k)
    assert store(tier, pool, keys, list(range(8)))
    pool.array[8:16] = 0
    assert all(tier.get_manager().lookup(k, CTX) == LookupResult.HIT for k in keys)
    assert load(tier, pool, keys, list(range(8, 16)))
    for c, k in enumerate(keys):
        np.testing.assert_array_equal(pool.chunk(8 + c), expected(k))


def test_files_are_private(make_tier, pool):
    tier = make_tier()
    d = tier.store.dir
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    for f in d.iterdir():
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f


def test_eviction_reuses_slots_and_keeps_bytes_right(make_tier, pool):
    tier = make_tier(capacity_slots=4)
    mgr = tier.get_manager()
    for i in range(12):
        k = key(i)
        fill(pool, 0, k)
        assert store(tier, pool, [k], [0], job_id=10 + i)
    held = [key(i) for i in range(12) if mgr.lookup(key(i), CTX) == LookupResult.HIT]
    assert held == [key(i) for i in range(8, 12)]
    assert load(tier, pool, held, list(range(4)))
    for c, k in enumerate(held):
        np.testing.assert_array_equal(pool.chunk(c), expected(k))
