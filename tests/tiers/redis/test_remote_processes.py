"""Two independent processes ('engines'): one stores and exits, the other
(this one, with its own tier) hits and reads the exact bytes back. Nothing
is shared but the server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvoffload.abstractions import LookupResult
from remote_helpers import expected, keys_for, load, lookup, make_tier

pytestmark = [pytest.mark.redis, pytest.mark.slow]

PROC = Path(__file__).with_name("remote_engine_proc.py")


def test_one_process_stores_another_hits(redis_server, prefix):
    n, seed = 12, 77
    tier, m, w, pool = make_tier(redis_server.url, prefix, num_chunks=n)
    other, m2, _w2, _p2 = make_tier(redis_server.url, prefix + "-other")
    try:
        keys = keys_for(n, seed=seed)
        assert all(lookup(m, k) is LookupResult.MISS for k in keys)  # nothing there yet
        out = subprocess.run([sys.executable, str(PROC), redis_server.url, prefix, str(seed), str(n)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        m.reset_cache()
        assert all(lookup(m, k) is LookupResult.HIT for k in keys)
        assert load(m, w, keys, list(range(n)))
        for j in range(n):
            assert np.array_equal(pool.chunk(j)[: pool.used_chunk_bytes], expected(pool, seed, j))
        # an engine with another prefix sees none of it
        assert all(lookup(m2, k) is LookupResult.MISS for k in keys)
    finally:
        tier.shutdown()
        other.shutdown()
