"""hubchain's hot loops (kvoffload/policies/hubchain/loops.py) and their C twin
(_hubchain_loops.c): random operations on two copies of the same state, one
through each; after every call both copies (every OrderedDict in its order,
every counter, every float to the last bit) and both results are equal. And
the whole policy through the real CPU manager makes the same choices with
either."""

from __future__ import annotations

import copy
import random
from collections import OrderedDict

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvoffload.policies.hubchain import loops
from kvoffload.policies.hubchain.learning import _BIN_BYTES, BINS
from kvoffload.tiers.cpu.manager import CPUOffloadingManager
from tests.policies.turns import keys, turn

native = loops.native
needs_native = pytest.mark.skipif(native is None, reason="the C twin did not build (setup.py: no compiler)")
PY = loops.PYTHON

# keys of one length whose hash byte (key[-5]) takes every value mod 16
POOL = [bytes([i, 0, (i * 37) % 256, 1, 2, 3, 4]) for i in range(40)]
ORDERS = ("order", "loose", "hubbed", "heads")


def _state(data) -> dict:
    """Four disjoint orders of POOL keys with rising last uses, and ghosts."""
    ks = data.draw(st.permutations(POOL))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ks)), min_size=3, max_size=3)))
    parts = [ks[:cuts[0]], ks[cuts[0]:cuts[1]], ks[cuts[1]:cuts[2]], ks[cuts[2]:]]
    state = {}
    for name, part in zip(ORDERS, parts):
        stamps = sorted(data.draw(st.lists(st.integers(-1, 30), min_size=len(part), max_size=len(part))))
        state[name] = OrderedDict(zip(part, stamps))
    for name in ("b1", "b2", "hub_ghosts", "recent", "sim"):
        state[name] = OrderedDict.fromkeys(data.draw(st.lists(st.sampled_from(POOL), max_size=12, unique=True)))
    state["branches"] = dict.fromkeys(data.draw(st.lists(st.sampled_from(POOL), max_size=8, unique=True)), 2)
    return state


def _snapshot(state: dict) -> dict:
    return {name: list(v.items()) if isinstance(v, dict) else copy.deepcopy(v) for name, v in state.items()}


def _both(state: dict, call) -> None:
    """call(fns, st) on a copy through each twin: same result (or same error), same state after."""
    twin = copy.deepcopy(state)
    out = []
    for fns, s in ((PY, state), (native.__dict__, twin)):
        try:
            out.append(("ok", call(fns, s)))
        except Exception as e:  # noqa: BLE001 (the twins must fail alike)
            out.append(("error", type(e)))
    assert out[0] == out[1]
    assert _snapshot(state) == _snapshot(twin)


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_order_loops_change_the_same_orders_alike(data):
    state = _state(data)
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(["stamp", "renew", "renew_all", "touch", "drop", "merge"]))
        ks = data.draw(st.lists(st.sampled_from(POOL), max_size=10))
        now = data.draw(st.integers(0, 40))
        if op in ("stamp", "renew", "renew_all"):
            name = data.draw(st.sampled_from(ORDERS + ("sim",)))
            _both(state, lambda f, s: f[op](s[name], ks, now))
        elif op == "touch":
            used = data.draw(st.sampled_from([now, now + 1]))
            _both(state, lambda f, s: f["touch"](ks, s["order"], s["loose"], s["heads"], s["hubbed"], used, now))
        elif op == "drop":
            resident = [k for name in ORDERS for k in state[name]]
            # distinct resident victims; now and then one that is not (a KeyError from both, alike)
            victims = data.draw(st.lists(st.sampled_from(resident), unique=True)) if resident else []
            if data.draw(st.booleans()) and len(resident) < len(POOL):
                victims.append(next(k for k in POOL if k not in resident))
            c = data.draw(st.integers(1, 30))  # (small: ARC's bounds and the ghosts' trims bite)
            _both(state, lambda f, s: f["drop"](victims, s["order"], s["loose"], s["hubbed"], s["heads"],
                                                s["b1"], s["b2"], s["hub_ghosts"], s["recent"], s["branches"], c))
        else:
            n = data.draw(st.integers(1, 45))
            p, q = data.draw(st.integers(0, 40)) + 0.5, float(data.draw(st.integers(0, 40)))
            stamps = [float(v) for v in state["order"].values()][:3]  # (a threshold at a block's own last use)
            threshold = data.draw(st.sampled_from([float("inf"), 10.0, 10.5, -5.0] + stamps))
            shift = data.draw(st.sampled_from([0.0, 2.0, 7.5]))
            own = dict.fromkeys(data.draw(st.lists(st.sampled_from(POOL), max_size=6)), 3)
            if not own and data.draw(st.booleans()):
                own = ()  # (what hubchain passes outside a store)
            held = set(data.draw(st.lists(st.sampled_from(POOL), max_size=6)))
            refused = set(data.draw(st.lists(st.sampled_from(POOL), max_size=6)))
            can_evict = data.draw(st.sampled_from([None, refused.isdisjoint, "raises"]))
            if can_evict is not None:
                can_evict = (lambda k: k not in refused) if can_evict is not refused.isdisjoint else can_evict
            if data.draw(st.booleans()) and can_evict is not None:
                def can_evict(k):  # noqa: F811 (a manager callback that fails: both let it through)
                    raise RuntimeError("boom")
            _both(state, lambda f, s: f["merge"](n, s["loose"], s["order"], s["hubbed"], s["heads"], p, q,
                                                 threshold, -shift, 8 * shift, own, held, can_evict))


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_learning_loops_count_alike(data):
    """follow and shadow: episodes started and ended (a key twice in one call,
    every sampling rate, the shadow counting or not), histograms whose adds
    round (their order shows), the shadow's order and its trim."""
    big = 2.0 ** 53
    state = {"sim": OrderedDict.fromkeys(data.draw(st.lists(st.sampled_from(POOL), max_size=10, unique=True))),
             "episodes": {}, "live": [0] * 9,
             "dist": ([big] * (BINS + 1), [0.7 * (b % 3) for b in range(BINS + 1)]),
             "hit": [big + 2 * b for b in range(BINS)], "miss": [0.3 * (b % 5) for b in range(BINS)]}
    now = 1
    for _ in range(data.draw(st.integers(1, 12))):
        now += data.draw(st.sampled_from([0, 1, 3, 200, 5000]))
        ks = data.draw(st.lists(st.sampled_from(POOL), max_size=12))
        cls, hit = data.draw(st.integers(0, 1)), data.draw(st.booleans())
        low = data.draw(st.integers(0, 3))
        k, s = data.draw(st.integers(low, 4)), data.draw(st.integers(0, 4))
        live_rates = [r for r, c in enumerate(state["live"]) if c]
        low = min([low] + live_rates)  # (hubchain's _low: no live episode's rate below it)
        cap, counting = data.draw(st.integers(1, 12)), data.draw(st.booleans())
        if data.draw(st.booleans()):
            _both(state, lambda f, st_: f["follow"](ks, cls, hit, now, low, k, s, st_["episodes"], st_["live"],
                                                    st_["dist"], st_["hit"] if hit else st_["miss"], st_["sim"],
                                                    cap, counting, _BIN_BYTES))
        else:
            _both(state, lambda f, st_: f["shadow"](st_["sim"], ks, hit, cap, counting))


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_resident_prefix_walk_finds_the_same_block(data):
    """prefix_end: positions in prefix order (the walk from the deep end) or
    not (its full-walk fallback), resident keys in any of the orders, cold
    ones (last use -1) skipped, the store's first key without a position."""
    state = _state(data)
    ks = data.draw(st.lists(st.sampled_from(POOL), unique=True, max_size=30))
    pos = sorted(data.draw(st.lists(st.integers(0, 60), min_size=len(ks), max_size=len(ks))))  # (ties too)
    if data.draw(st.booleans()):  # out of prefix order now and then
        pos = data.draw(st.permutations(pos))
    positions = dict(zip(ks, pos))
    first = data.draw(st.sampled_from(ks + [POOL[0]])) if ks else POOL[0]
    orders = tuple(state[name] for name in ORDERS)
    _both({"positions": positions}, lambda f, s: f["prefix_end"](s["positions"], first, orders))


@needs_native
def test_the_resident_prefix_walk_leaves_other_values_to_the_python_twin():
    """Positions or last uses that are not ints (no caller passes them): the
    C twin declines, and the module's prefix_end gives the Python's answer."""
    a, b, c = POOL[:3]
    for positions, orders in (({a: 1.0, b: 2.0, c: 3.0}, (OrderedDict({a: 5}),)),
                              ({a: 1, b: 2, c: 3}, (OrderedDict({b: 5.5}),)),
                              ({a: 1, b: 2, c: 3}, [OrderedDict({a: 5})])):
        assert native.prefix_end(positions, c, orders) is NotImplemented
        assert loops.prefix_end(positions, c, orders) == PY["prefix_end"](positions, c, orders)
    assert loops.prefix_end({a: 1, b: 2, c: 3}, c, (OrderedDict({b: 5.5}),)) == (5.5, b)


@needs_native
def test_follow_leaves_keys_of_other_lengths_to_the_python_twin():
    """Keys of mixed lengths sample other hash bytes in Python (hash_bytes);
    the C twin declines them and the module's follow gives the Python's."""
    mixed = [b"\x00" * 12, b"\x00" * 8, b"\x00" * 16]  # 36 = 3 x 12: sliced from the joined buffer
    args = lambda: (mixed, 0, False, 5, 0, 2, 2, {}, [0] * 9, ([0.0] * (BINS + 1), [0.0] * (BINS + 1)),  # noqa: E731
                    [0.0] * BINS, OrderedDict(), 8, True, _BIN_BYTES)
    assert native.follow(*args()) is NotImplemented
    got, want = args(), args()
    assert loops.follow(*got) == PY["follow"](*want)
    assert got[7] == want[7] and list(got[11]) == list(want[11])


@needs_native
def test_hubchain_makes_the_same_choices_with_either_twin(monkeypatch):
    """Agentic-style conversations and one-shot prompts after a shared prefix
    through the real CPU manager: every store's outcome and the final
    residents and learning state are the same with the Python loops as with
    the C ones."""
    rng = random.Random(7)
    system = keys(500, 6)
    reqs = []
    for conv in range(60):
        ctx = system + keys(conv, rng.randint(2, 10))
        for t in range(rng.randint(1, 4)):
            reqs.append(list(ctx))
            ctx += keys(1000 + conv * 10 + t, rng.randint(1, 6))
    rng.shuffle(reqs)

    def run(use_native: bool):
        fns = native.__dict__ if use_native else PY
        for name in ("stamp", "renew", "renew_all", "touch", "drop", "merge", "shadow", "follow"):
            monkeypatch.setattr(loops, name, fns[name])
        monkeypatch.setattr(loops, "NATIVE", use_native)
        m = CPUOffloadingManager(64, "hubchain")
        hits = [turn(m, r) for r in reqs]
        pol = m.policy
        return (hits, [list(getattr(pol, "_" + name).items()) for name in ORDERS], pol.shift, pol._p, pol._q,
                pol._dist, list(pol._episodes.items()), list(pol._sim))

    with_c, with_python = run(True), run(False)
    assert with_c == with_python
    assert sum(with_c[0]) > 0  # (the workload hits: the comparison is not of empty runs)


@needs_native
@pytest.mark.parametrize("call", [
    lambda: native.renew([], POOL[:2], 1),
    lambda: native.renew_all(None, POOL[:2], 1),
    lambda: native.touch(POOL[:2], OrderedDict(), [POOL[0]], OrderedDict(), OrderedDict(), 1, 1),
    lambda: native.shadow(None, POOL[:2], True, 10, True),
    lambda: native.drop(POOL[:1], [], OrderedDict(), OrderedDict(), OrderedDict(), OrderedDict(), OrderedDict(),
                        OrderedDict(), OrderedDict(), {}, 4),
    lambda: native.merge(2, [POOL[0]], OrderedDict(), OrderedDict(), OrderedDict(), 0.0, 9.0, 1e9, 0.0, 0.0, (),
                         set(), None),
], ids=["renew", "renew_all", "touch", "shadow", "drop", "merge"])
def test_the_c_twin_refuses_what_is_not_an_ordereddict(call):
    """PyDict_Contains does not check its argument: without the check these
    crashed the interpreter (a list or None where an order goes)."""
    with pytest.raises(TypeError, match="expected an OrderedDict"):
        call()


@needs_native
def test_the_c_merge_refuses_offsets_that_are_not_finite_and_drop_a_capacity_out_of_range():
    """Every walk's next block at an infinite (or NaN) shifted last use made
    the merge take a walk that had ended (a NULL key: a crash); a capacity
    near 2**63 overflowed ARC's 2c bound."""
    orders = (OrderedDict(), OrderedDict(), OrderedDict([(POOL[0], 1)]), OrderedDict([(POOL[1], 1)]))
    for off in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite"):
            native.merge(2, *orders, 9.0, 9.0, float("inf"), off, off, (), set(), None)
    for c in (0, 3 * 2 ** 61):
        with pytest.raises(ValueError, match="capacity"):
            native.drop([], *(OrderedDict() for _ in range(8)), {}, c)


@needs_native
def test_the_c_twin_reads_its_own_copy_of_the_keys():
    """A key whose hash empties the caller's list while stamp runs (the C
    read the list's items by index: freed pointers)."""
    class Emptying:
        def __init__(self, keys):
            self.keys = keys

        def __hash__(self):
            self.keys.clear()
            return 1

    keys = POOL[:3]
    keys.append(Emptying(keys))
    od = OrderedDict()
    native.stamp(od, keys, 5)
    assert list(od.values()) == [5, 5, 5, 5] and keys == []


@needs_native
def test_follow_leaves_clocks_and_episodes_out_of_range_to_the_python_twin():
    """A clock past 2**54 ((now << 8) overflowed) or an episode that starts
    after `now` (read past the histogram's table): the C declines before it
    changes anything, and the module's follow gives the Python's result."""
    k = POOL[0]

    def args(now, episodes):
        return ([k], 0, True, now, 0, 0, 0, episodes, [0] * 9, [[0.0] * 4, [0.0] * 4], [0.0] * 4, OrderedDict(),
                8, False, bytes(4))

    for now, episodes in ((2 ** 56, {}), (5, {k: (7 << 8) | 1}), (5, {k: "not an int"})):
        raw = args(now, episodes)
        before = copy.deepcopy(raw)
        assert native.follow(*raw) is NotImplemented
        assert repr(raw) == repr(before)  # nothing changed
        if isinstance(episodes.get(k, 0), int):
            got, want = args(now, dict(episodes)), args(now, dict(episodes))
            assert loops.follow(*got) == PY["follow"](*want)
            assert repr(got) == repr(want)
