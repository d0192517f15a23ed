"""Hypothesis: any sequence of stores, loads, failed stores and restarts
leaves every key the tier calls a HIT reading back its own bytes, within
capacity, and a restart keeps every settled key (plus, possibly, evicted
ones whose slot was never rewritten: their bytes are still right)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.abstractions import CPULoadStoreSpec, LookupResult
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.storage.tier import StorageTier
from storage_helpers import CHUNK, CTX, NS, close, expected, fill, key, load, store

CAP = 6
ops = st.lists(st.one_of(
    st.tuples(st.just("store"), st.lists(st.integers(0, 15), min_size=1, max_size=4)),
    st.tuples(st.just("fail"), st.lists(st.integers(0, 15), min_size=1, max_size=3)),
    st.tuples(st.just("load"), st.integers(0, 15)),
    st.tuples(st.just("restart"), st.none()),
), min_size=1, max_size=25)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_hits_always_read_back_their_own_bytes(tmp_path_factory, ops):
    path = str(tmp_path_factory.mktemp("inv"))
    pool = HostPool(8, CHUNK)
    tier = StorageTier(path, CAP * CHUNK, CHUNK, NS, num_files=2, io_threads=2)
    job = 0
    try:
        for op, arg in ops:
            mgr = tier.get_manager()
            job += 1
            if op == "store":
                keys = list(dict.fromkeys(key(i) for i in arg))
                for c, k in enumerate(keys):
                    fill(pool, c, k)
                store(tier, pool, keys, list(range(len(keys))), job_id=job)
            elif op == "fail":  # prepared, then the write is reported failed
                keys = list(dict.fromkeys(key(i) for i in arg))
                out = mgr.prepare_store(keys, CTX)
                if out is not None:
                    mgr.complete_store(out.keys_to_store, CTX, success=False)
            elif op == "load":
                k = key(arg)
                if mgr.lookup(k, CTX) is LookupResult.HIT:
                    assert load(tier, pool, [k], [7], job_id=job)
                    np.testing.assert_array_equal(pool.chunk(7), expected(k))
            else:
                before = {k for k in mgr._slot_of}
                close(tier)
                tier = StorageTier(path, CAP * CHUNK, CHUNK, NS, num_files=2, io_threads=2)
                assert before <= set(tier.get_manager()._slot_of)
            held = [k for k in tier.get_manager()._slot_of]
            assert len(held) <= CAP
        held = list(tier.get_manager()._slot_of)
        if held:
            tier.get_worker(pool)
            spec = tier.get_manager().prepare_load(held, CTX)
            w = tier.get_worker(pool)
            w.submit_load(10_000, spec, CPULoadStoreSpec(range(len(held))))
            w.wait({10_000})
            assert all(r.success for r in w.get_finished())
            tier.get_manager().complete_load(held, CTX)
            for c, k in enumerate(held):
                np.testing.assert_array_equal(pool.chunk(c), expected(k))
    finally:
        close(tier)
        pool.close()
