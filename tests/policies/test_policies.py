"""Eviction policies: registry, LRU and ARC ordering, atomic evict."""

import copy

import pytest

from kvoffload.abstractions import ReqContext
from kvoffload.config import ConfigError
from kvoffload.policies import EvictionPolicy, get_policy_class, policy_names, register_policy
from kvoffload.policies.arc import ARCPolicy
from kvoffload.policies.lru import LRUPolicy
from kvoffload.tiers.cpu.manager import CPUOffloadingManager


def K(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\0\0\0\0"


def ks(*ids):
    return [K(i) for i in ids]


def always(_k):
    return True


class FIFOPolicy(EvictionPolicy):
    """A user policy, plugged by module path."""

    name = "fifo"

    def __init__(self, capacity):
        super().__init__(capacity)
        self.keys = []

    def insert(self, keys, ctx):
        self.keys.extend(keys)

    def touch(self, keys, ctx):
        pass

    def remove(self, key):
        if key in self.keys:
            self.keys.remove(key)

    def evict(self, n, can_evict):
        victims = [k for k in self.keys if can_evict(k)][:n]
        if len(victims) < n:
            return None
        for k in victims:
            self.keys.remove(k)
        return victims

    def __len__(self):
        return len(self.keys)

    def __contains__(self, key):
        return key in self.keys


def test_registry_names_and_module_paths():
    assert {"lru", "arc"} <= set(policy_names())
    assert get_policy_class("lru") is LRUPolicy
    assert get_policy_class("ARC") is ARCPolicy
    assert get_policy_class("kvoffload.policies.arc:ARCPolicy") is ARCPolicy
    assert get_policy_class(f"{__name__}:FIFOPolicy") is FIFOPolicy
    m = CPUOffloadingManager(2, f"{__name__}:FIFOPolicy")
    for k in ks(1, 2):
        m.prepare_store([k], None)
        m.complete_store([k], None)
    m.touch(ks(1), None)
    assert m.prepare_store(ks(3), None).evicted_keys == ks(1)  # FIFO ignores the touch


def test_register_policy():
    register_policy("fifo-test", FIFOPolicy)
    assert get_policy_class("fifo-test") is FIFOPolicy
    with pytest.raises(TypeError, match="not an EvictionPolicy"):
        register_policy("bad", dict)


@pytest.mark.parametrize("name, match", [
    ("mru", r"unknown eviction policy 'mru'.*'arc'.*'lru'"),
    ("nosuchmodule:Foo", "cannot load eviction policy 'nosuchmodule:Foo'"),
    ("kvoffload.policies.lru:Nope", "cannot load eviction policy"),
    ("collections:OrderedDict", "not an EvictionPolicy subclass"),
    (3, "must be a name"),
])
def test_bad_policy_names(name, match):
    with pytest.raises(ConfigError, match=match):
        get_policy_class(name)


@pytest.mark.parametrize("cls", [LRUPolicy, ARCPolicy])
@pytest.mark.parametrize("bad", [0, -1, 2.0, None])
def test_bad_capacity(cls, bad):
    with pytest.raises(ConfigError, match="capacity"):
        cls(bad)


@pytest.mark.parametrize("cls", [LRUPolicy, ARCPolicy])
def test_prefix_tail_goes_before_head(cls):
    p = cls(8)
    p.insert(ks(1, 2, 3), None)
    p.insert(ks(4, 5), None)
    assert p.evict(5, always) == ks(3, 2, 1, 5, 4)
    assert len(p) == 0


@pytest.mark.parametrize("cls", [LRUPolicy, ARCPolicy])
def test_evict_is_atomic(cls):
    p = cls(8)
    p.insert(ks(1, 2, 3, 4), None)
    p.touch(ks(2), None)
    before = copy.deepcopy(p.__dict__)
    assert p.evict(3, lambda k: k != K(1) and k != K(3)) is None
    assert p.evict(5, always) is None
    assert p.__dict__ == before
    assert p.evict(0, always) == []
    assert sorted(p.evict(2, lambda k: k != K(1) and k != K(3))) == ks(2, 4)
    assert K(1) in p and K(2) not in p


@pytest.mark.parametrize("cls", [LRUPolicy, ARCPolicy])
def test_remove_and_unknown_touch(cls):
    p = cls(4)
    p.insert(ks(1, 2), None)
    p.touch(ks(9), None)
    p.remove(K(1))
    p.remove(K(9))
    assert len(p) == 1 and K(2) in p and K(1) not in p


def test_lru_touch_moves_to_most_recent_keeping_head_last():
    p = LRUPolicy(8)
    p.insert(ks(1, 2, 3, 4), None)
    p.touch(ks(1, 2), None)
    assert p.evict(4, always) == ks(4, 3, 2, 1)


def test_arc_scan_does_not_flush_frequent_keys():
    p = ARCPolicy(4)
    p.insert(ks(1, 2), None)
    p.touch(ks(1, 2), None)  # seen twice: T2
    for i in range(10, 20):  # a scan of one-time keys
        if len(p) == 4:
            assert all(v >= 10 for v in (int.from_bytes(k[:8], "big") for k in p.evict(1, always)))
        p.insert(ks(i), None)
    assert K(1) in p and K(2) in p


def test_arc_ghost_hit_adapts_target():
    p = ARCPolicy(4)
    p.insert(ks(1, 2, 3, 4), None)
    assert p.evict(2, always) == ks(4, 3)
    assert list(p.b1) == ks(4, 3)
    p_before = p.p
    p.insert(ks(3), None)  # a recently evicted once-seen key is back: T1 was too small
    assert p.p > p_before and K(3) in p.t2 and K(3) not in p.b1
    p.touch(ks(1), None)
    p.evict(2, lambda k: True)
    # ghosts stay bounded by ARC's directory size
    assert len(p.t1) + len(p.b1) <= 4 and len(p.t1) + len(p.t2) + len(p.b1) + len(p.b2) <= 8


def test_arc_ghosts_stay_bounded_over_a_long_run():
    p = ARCPolicy(8)
    for i in range(1000):
        if len(p) == 8:
            p.evict(1, always)
        if K(i % 37) not in p:
            p.insert(ks(i % 37), None)
        if i % 3 == 0:
            p.touch(ks((i * 7) % 37), None)
        assert len(p.t1) + len(p.b1) <= 8
        assert len(p) + len(p.b1) + len(p.b2) <= 16
        assert 0 <= p.p <= 8


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ops = st.lists(st.tuples(st.sampled_from(["insert", "touch", "refresh", "evict", "remove"]),
                         st.lists(st.integers(0, 15), min_size=1, max_size=4),
                         st.frozensets(st.integers(0, 15), max_size=6)), max_size=40)


@pytest.mark.parametrize("cls", [LRUPolicy, ARCPolicy])
@settings(max_examples=150, deadline=None)
@given(ops=ops)
def test_policy_evict_contract_under_random_use(cls, ops):
    p = cls(6)
    held: set[bytes] = set()
    # no request, or one of three (whose stores a policy may group while they run)
    ctxs = [None, ReqContext("a"), ReqContext("b"), ReqContext("c")]
    for c in ctxs[1:]:
        for i in range(16):
            c.set_offload_key_position(K(i), (i + 1) * 16)
    for op, ids, pinned in ops:
        ctx = ctxs[sum(ids) % len(ctxs)]
        ids = list(dict.fromkeys(ids))
        if op == "insert":
            new = [K(i) for i in ids if K(i) not in held][: 6 - len(held)]
            p.insert(new, ctx)
            held.update(new)
        elif op in ("touch", "refresh"):
            getattr(p, op)([K(i) for i in ids], ctx)
        elif op == "remove":
            for i in ids:
                p.remove(K(i))
                held.discard(K(i))
        else:
            blocked = {K(i) for i in pinned}
            before = copy.deepcopy(p.__dict__)
            n = len(ids)
            victims = p.evict(n, lambda k: k not in blocked)
            if victims is None:
                assert len(held - blocked) < n
                assert p.__dict__ == before
            else:
                assert len(victims) == n == len(set(victims))
                assert set(victims) <= held - blocked
                held -= set(victims)
        assert len(p) == len(held) and all(k in p for k in held)
