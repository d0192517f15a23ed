"""The remote manager (a real redis-server): a call that raises on a bad
argument changes nothing (issue 13 §2). Like the storage manager it sits
behind the tiered manager, which only hands it keys the CPU tier accepted,
so a bad key may pass; but one that raises must leave the state as it was."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from remote_helpers import keys_for, make_tier, store

sys.path.insert(0, str(Path(__file__).parents[2]))  # tests/: the shared helpers
from atomicity import BAD_KEYS, deep_state  # noqa: E402

from kvoffload.abstractions import ReqContext  # noqa: E402

pytestmark = pytest.mark.redis

# What the scheduler thread owns; the checker and worker threads own the rest.
SCHEDULER_STATE = ("_present", "_absent", "_checking", "_storing", "_c", "_n", "_events")


def state(m) -> list:
    return [deep_state(getattr(m, a)) for a in SCHEDULER_STATE]


@pytest.mark.parametrize("bad", BAD_KEYS, ids=repr)
@pytest.mark.parametrize("method", ["lookup", "prepare_load", "touch", "prepare_store", "complete_store"])
def test_remote_call_that_raises_changes_nothing(redis_server, prefix, method, bad):
    tier, m, worker, pool = make_tier(redis_server.url, prefix, num_chunks=8)
    try:
        ctx = ReqContext("r")
        stored, pending = keys_for(3), keys_for(2, seed=1)
        assert store(m, worker, stored, [0, 1, 2])
        assert m.prepare_store(pending, ctx).keys_to_store == pending
        arg = bad if method == "lookup" else [stored[0], bad, *pending]
        before = state(m)
        try:
            getattr(m, method)(arg, ctx)
        except (TypeError, ValueError, KeyError, AttributeError):
            assert state(m) == before
    finally:
        tier.shutdown()
        pool.close()


def test_lookup_of_a_bad_key_keeps_the_checker_working(redis_server, prefix):
    """A hashable key that is not bytes gets through lookup() to the
    existence checker's thread: it is answered absent there, and keys
    looked up with it or after it are still checked."""
    from remote_helpers import lookup

    from kvoffload.abstractions import LookupResult

    tier, m, worker, pool = make_tier(redis_server.url, prefix, num_chunks=8)
    try:
        good = keys_for(2, seed=7)
        assert store(m, worker, good, [0, 1])
        m.reset_cache()
        ctx = ReqContext("r")
        m.lookup(5, ctx)
        m.lookup(good[0], ctx)  # queued in the same round as the bad key
        assert lookup(m, 5) is LookupResult.MISS
        assert lookup(m, good[0]) is LookupResult.HIT
        assert lookup(m, good[1]) is LookupResult.HIT  # a later round
    finally:
        tier.shutdown()
        pool.close()
