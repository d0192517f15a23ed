"""No manager call may leave state half-changed when it raises (issue 13 §2).

Each manager is driven into a random state with real work (stores pending
and completed, loads in flight), then called with one bad argument: a
malformed key or a key in the wrong state placed anywhere among good keys,
or a request context of the wrong type. The call must raise, and the
manager's whole state (deep_state: every attribute, the eviction policy's
order, counters, events, the request's records) must be what it was.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from atomicity import BAD_KEYS, deep_state
from hypothesis import HealthCheck, given, settings

from kvoffload.abstractions import ReqContext, ScheduleEndContext
from kvoffload.keys import make_offload_key
from kvoffload.tiering import Tier, TieringManager
from kvoffload.tiers.base import Namespace
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.cpu.manager import CPUOffloadingManager
from kvoffload.tiers.storage.tier import StorageTier

KEYS = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(10)]
CHUNK = 4096
NS = Namespace(model="m", dtype="f16", layout="t", block_size=16, chunk_bytes=CHUNK)
END = ScheduleEndContext((), ())
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# A random history: which keys are stored (completed), which pending, which pinned.
histories = st.tuples(
    st.lists(st.sampled_from(KEYS[:6]), min_size=1, max_size=4, unique=True),  # stored
    st.lists(st.sampled_from(KEYS[6:9]), max_size=2, unique=True),  # pending
    st.integers(0, 3),  # how many stored keys get a load in flight
    st.booleans(),  # low retention request
)


def ctx_for(low: bool) -> ReqContext:
    c = ReqContext("r", {"kv_retention": "low"} if low else None)
    for i, k in enumerate(KEYS):
        c.set_offload_key_position(k, (i + 1) * 16)
    return c


def drive(m, history, settle=lambda: None):
    """Put manager m into the history's state; returns (ctx, stored, pending, pinned)."""
    stored, pending, n_pinned, low = history
    ctx = ctx_for(low)
    m.on_new_request(ctx)
    out = m.prepare_store(stored, ctx)
    m.complete_store(out.keys_to_store, ctx)
    settle()
    pinned = stored[:n_pinned]
    if pinned:
        m.prepare_load(pinned, ctx)
    if pending:
        assert m.prepare_store(pending, ctx).keys_to_store == pending
    return ctx, stored, pending, pinned


def bad_calls(stored, pending, pinned, bad, at):
    """(method, keys) pairs that must raise: the bad key inserted at position at."""
    def with_bad(keys):
        keys = list(keys)
        keys.insert(min(at, len(keys)), bad)
        return keys

    unknown = KEYS[9]
    unpinned = [k for k in stored if k not in pinned]
    calls = [
        ("prepare_load", with_bad(stored)),
        ("prepare_load", stored[:at] + [unknown] + stored[at:]),
        ("complete_load", with_bad(pinned)),
        ("prepare_store", with_bad([unknown] + pending)),
        ("complete_store", with_bad(pending)),
        ("complete_store", pending[:at] + [unknown] + pending[at:]),
    ]
    if not isinstance(bad, bytes):  # lookup and touch check types only (hot path): a short key is unknown
        calls += [("lookup", bad), ("lookup_prefix", with_bad(stored)), ("touch", with_bad(stored))]
    if pending:
        calls.append(("prepare_load", stored[:at] + [pending[0]] + stored[at:]))  # still being written
    if unpinned:
        calls.append(("complete_load", pinned[:at] + [unpinned[0]] + pinned[at:]))  # no load in flight
    return calls


def call(m, method, arg, ctx):
    return getattr(m, method)(arg, ctx)


def assert_each_raises_and_changes_nothing(m, calls, ctx, state, errors=(TypeError, ValueError, KeyError)):
    for method, arg in calls:
        before = state()
        with pytest.raises(errors):
            call(m, method, arg, ctx)
            print(f"{method}({arg!r}) did not raise")
        assert state() == before, f"{method}({arg!r}) raised but changed the state"


# ---- the CPU manager --------------------------------------------------------

@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo", "sieve", "hubchain"])
@SETTINGS
@given(history=histories, bad=st.sampled_from(BAD_KEYS), at=st.integers(0, 4))
def test_cpu_manager_calls_that_raise_change_nothing(policy, history, bad, at):
    m = CPUOffloadingManager(8, policy, enable_events=True)
    ctx, stored, pending, pinned = drive(m, history)
    calls = bad_calls(stored, pending, pinned, bad, at)
    assert_each_raises_and_changes_nothing(m, calls, ctx, lambda: (deep_state(m), deep_state(ctx)))


@pytest.mark.parametrize("policy", ["lru", "arc", "hubchain"])  # hubchain reads the context too
@SETTINGS
@given(history=histories, bad_ctx=st.sampled_from(["r", 5, object()]))
def test_cpu_manager_with_a_context_of_the_wrong_type_changes_nothing(policy, history, bad_ctx):
    m = CPUOffloadingManager(8, policy, enable_events=True)
    _, stored, pending, pinned = drive(m, history)
    calls = [("prepare_load", stored), ("touch", stored)] + ([("complete_store", pending)] if pending else [])
    assert_each_raises_and_changes_nothing(m, calls, bad_ctx, lambda: deep_state(m), (TypeError, AttributeError))


# ---- the storage manager ------------------------------------------------------

@pytest.fixture
def storage_tier(tmp_path):
    """A fresh storage tier per call (hypothesis calls the test many times); the caller shuts it down."""
    made = iter(range(1 << 30))
    return lambda: StorageTier(str(tmp_path / f"kv{next(made)}"), 8 * CHUNK, CHUNK, NS, enable_events=True)


STORAGE_SKIP = frozenset({"store"})  # the slab files: written by the worker, not by these calls


@SETTINGS
@given(history=histories, bad=st.sampled_from(BAD_KEYS), at=st.integers(0, 4))
def test_storage_manager_calls_that_raise_change_nothing(storage_tier, history, bad, at):
    """The storage manager checks less than the CPU one (it sits behind the
    tiered manager, which hands it only keys the CPU tier accepted): a call
    with a bad key may pass, but one that raises must change nothing."""
    m = storage_tier().get_manager()
    try:
        ctx, stored, pending, pinned = drive(m, history)
        for method, arg in bad_calls(stored, pending, pinned, bad, at) + [("lookup", bad), ("touch", [bad])]:
            before = (deep_state(m, STORAGE_SKIP), deep_state(ctx))
            try:
                call(m, method, arg, ctx)
            except (TypeError, ValueError, KeyError):
                assert (deep_state(m, STORAGE_SKIP), deep_state(ctx)) == before, f"{method}({arg!r})"
            else:
                m = fresh_storage(m, storage_tier, history)
                ctx = ctx_for(history[3])
    finally:
        m.shutdown()


def fresh_storage(m, storage_tier, history):
    """A call passed and changed what it changed: go on from a new manager in the same state."""
    m.shutdown()
    m = storage_tier().get_manager()
    drive(m, history)
    return m


@pytest.mark.parametrize("method", ["complete_load", "lookup"])
def test_storage_call_with_an_unhashable_key_changes_nothing(storage_tier, method):
    m = storage_tier().get_manager()
    try:
        ctx, stored, _, pinned = drive(m, (KEYS[:2], [], 2, False))
        before = deep_state(m, STORAGE_SKIP)
        with pytest.raises(TypeError):
            if method == "lookup":
                m.lookup([b"x" * 20], ctx)
            else:
                m.complete_load([pinned[0], [b"x" * 20]], ctx)
        assert deep_state(m, STORAGE_SKIP) == before
    finally:
        m.shutdown()


# ---- the tiering manager ----------------------------------------------------

@SETTINGS
@given(history=histories, bad=st.sampled_from(BAD_KEYS), at=st.integers(0, 4))
def test_tiering_manager_calls_that_raise_change_nothing(storage_tier, history, bad, at):
    pool = HostPool(8, CHUNK)
    storage = storage_tier()
    mgr = TieringManager(CPUOffloadingManager(8, enable_events=True), [Tier(storage)])
    mgr.attach_workers([storage.get_worker(pool)])
    try:
        def settle():
            mgr.on_schedule_end(END)
            mgr.wait_idle()

        ctx, stored, pending, pinned = drive(mgr, history, settle)
        settle()
        calls = bad_calls(stored, pending, pinned, bad, at)
        skip = STORAGE_SKIP | {"worker"}
        assert_each_raises_and_changes_nothing(mgr, calls, ctx, lambda: (deep_state(mgr, skip), deep_state(ctx)))
    finally:
        mgr.shutdown()
        pool.close()
