"""What the CPU manager answers an offer, for every policy.

vLLM's connector moves past every key of an answered offer (an empty answer
included) and offers again only what was answered None. So an answer is
None or stores every new (not held) key it does not count declined
(store_blocks_declined: the policy's choice, e.g. the chain family keeping
a request's prefix whole). And when no slot is free or evictable (all
pinned by loads, cascades, or being written) the answer is None whatever
the policy: nothing is cut for good for want of a slot now.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from kvoffload.abstractions import ReqContext
from kvoffload.keys import make_offload_key
from kvoffload.policies import policy_names
from kvoffload.tiers.cpu.manager import CPUOffloadingManager
from kvoffload.tiers.cpu.slot_state import PENDING

CAPACITY = 6
PREFIX_LEN = 8  # keys per request: a few prefixes, longer than CPU
picks = st.integers(0, 1000)


def K(prefix: int, i: int) -> bytes:
    return make_offload_key(bytes([prefix, i]) * 4, 0)


def request(req_id: str, prefix: int) -> ReqContext:
    ctx = ReqContext(req_id)
    for i in range(PREFIX_LEN):
        ctx.set_offload_key_position(K(prefix, i), (i + 1) * 16)
    return ctx


@pytest.mark.parametrize("policy", policy_names())
def test_an_offer_finding_every_slot_pinned_is_answered_none(policy):
    """The issue's repro: 8 chunks stored and all pinned by loads, 3 new keys
    offered. hubchain, chain and segchain answered an empty store (vLLM
    never offered those keys again); every policy answers None now, and the
    same offer is stored once the loads complete."""
    m = CPUOffloadingManager(8, policy)
    ctx = request("a", 0)
    held = [K(0, i) for i in range(8)]
    out = m.prepare_store(held, ctx)
    m.complete_store(out.keys_to_store, ctx)
    m.prepare_load(held, ReqContext("b"))
    new = [K(1, i) for i in range(3)]
    offer = request("c", 1)
    m.get_stats()
    assert m.prepare_store(new, offer) is None
    assert m.get_stats().counters["allocation_failures"] == 1
    m.complete_load(held, ReqContext("b"))
    out = m.prepare_store(new, offer)
    assert out is not None
    declined = m.get_stats().counters["store_blocks_declined"]
    assert len(out.keys_to_store) + declined == 3


def test_an_offer_whose_only_evictable_keys_are_its_own_is_answered_none():
    """The offer's own held keys stay (a store never evicts what it keeps):
    with everything else pinned there is no room, whatever is unpinned."""
    m = CPUOffloadingManager(4, "hubchain")
    ctx = request("a", 0)
    held = [K(0, i) for i in range(4)]
    m.complete_store(m.prepare_store(held, ctx).keys_to_store, ctx)
    m.prepare_load(held[2:], None)  # two pinned, two readable and unpinned
    assert m.prepare_store(held[:2] + [K(0, 4)], ctx) is None
    assert m.room(held[:2] + [K(0, 4)]) == 0 and m.room() == 2


class StoreAnswers(RuleBasedStateMachine):
    """Requests store their prefixes in steps (as a scheduler offers them),
    loads pin keys, stores complete or fail; each answer is checked."""

    policy = "lru"

    def __init__(self):
        super().__init__()
        self.m = CPUOffloadingManager(CAPACITY, self.policy)
        self.running: dict[str, tuple[ReqContext, int, int]] = {}  # id -> (ctx, prefix, next key)
        self.stores: list[tuple[ReqContext, list[bytes]]] = []
        self.loads: list[list[bytes]] = []
        self.n = 0
        self.m.get_stats()

    @precondition(lambda self: len(self.running) < 3)
    @rule(prefix=st.integers(0, 3), start=st.integers(0, 3))
    def new_request(self, prefix, start):
        ctx = request(f"r{self.n}", prefix)
        self.n += 1
        self.m.on_new_request(ctx)
        self.running[ctx.req_id] = (ctx, prefix, start)

    @precondition(lambda self: self.running)
    @rule(i=picks, n=st.integers(1, 4), again=st.integers(0, 2))
    def offer(self, i, n, again):
        """The request's next n keys, with up to `again` keys before them
        (held already, as vLLM's offers of a hybrid model's groups are)."""
        rid = sorted(self.running)[i % len(self.running)]
        ctx, prefix, nxt = self.running[rid]
        if nxt >= PREFIX_LEN:
            return
        keys = [K(prefix, j) for j in range(max(0, nxt - again), min(PREFIX_LEN, nxt + n))]
        m = self.m
        new = [k for k in keys if k not in m]
        no_room = m.room(keys) == 0
        out = m.prepare_store(keys, ctx)
        c = m.get_stats().counters
        declined = c["store_blocks_declined"]
        if out is None:
            assert declined == 0
            event("None, no room" if no_room else "None")
            return  # offered again (here: maybe, by a later rule)
        assert not (new and no_room), "no slot free or evictable, yet an answer that is not None"
        stored = set(out.keys_to_store)
        assert stored <= set(new)
        assert len(new) - len(stored) == declined, (new, out.keys_to_store, declined)
        event("declined" if declined else "stored whole")
        assert list(out.keys_to_store) == new[:len(stored)]  # a head of the new keys, in order
        self.running[rid] = (ctx, prefix, nxt + n)
        if out.keys_to_store:
            self.stores.append((ctx, list(out.keys_to_store)))

    @precondition(lambda self: self.stores)
    @rule(i=picks, success=st.booleans())
    def complete_store(self, i, success):
        ctx, keys = self.stores.pop(i % len(self.stores))
        self.m.complete_store(keys, ctx, success=success)

    @rule(picked=st.lists(picks, min_size=1, max_size=CAPACITY))
    def load(self, picked):
        m = self.m
        ready = sorted(k for k, slot in m._slot_of.items() if m._state[slot] != PENDING)
        if not ready:
            return
        keys = list(dict.fromkeys(ready[i % len(ready)] for i in picked))
        m.prepare_load(keys, None)
        self.loads.append(keys)

    @precondition(lambda self: self.loads)
    @rule(i=picks)
    def complete_load(self, i):
        self.m.complete_load(self.loads.pop(i % len(self.loads)), None)

    @precondition(lambda self: self.running)
    @rule(i=picks)
    def finish(self, i):
        rid = sorted(self.running)[i % len(self.running)]
        ctx, _, _ = self.running.pop(rid)
        self.m.on_request_finished(ctx)


def _case(policy: str):
    machine = type(f"StoreAnswers_{policy}", (StoreAnswers,), {"policy": policy})
    case = machine.TestCase
    case.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
    return case


for _p in policy_names():
    globals()[f"TestStoreAnswers_{_p}"] = _case(_p)
