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
