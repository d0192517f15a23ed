"""The CPU manager's pins of a whole call through numpy (tiers/cpu/slot_state.py,
from VECTOR_MIN keys) end in the same state and raise the same errors as
its key-by-key loop; pins past a byte's 254 are counted beside it."""

from __future__ import annotations

import random

import pytest

from atomicity import deep_state
from kvoffload.tiers.cpu import manager as cpu_manager
from kvoffload.tiers.cpu.manager import BlockStateError, CPUOffloadingManager
from kvoffload.tiers.cpu.slot_state import MAX_PINS, PENDING

N = 300


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") + bytes(4)


def run_ops(seed: int) -> list:
    """Random stores, loads (big batches, some listing a key twice, some
    hitting a pending key) and their completions; every outcome and state."""
    rng = random.Random(seed)
    m = CPUOffloadingManager(N)
    out = []
    held: list[bytes] = []
    loads: list[list[bytes]] = []
    pending: list[bytes] = []
    for step in range(80):
        op = rng.choice(["store", "complete", "load", "load", "unload", "unload"])
        try:
            if op == "store" or not held:
                keys = [key(rng.randrange(2 * N)) for _ in range(rng.choice([10, 70, 120]))]
                r = m.prepare_store(keys)
                if r is not None and r.keys_to_store:
                    pending = list(r.keys_to_store)
                    if rng.random() < 0.7:
                        m.complete_store(pending)
                        held += pending
                        pending = []
                out.append(("store", None if r is None else (list(r.keys_to_store), list(r.evicted_keys))))
            elif op == "complete" and pending:
                m.complete_store(pending)
                held += pending
                pending = []
            elif op == "load":
                keys = rng.sample(sorted(set(held) & set(m._slot_of)), min(len(set(held) & set(m._slot_of)), 100))
                if keys and rng.random() < 0.2:
                    keys.append(keys[0])  # a key listed twice
                if pending and rng.random() < 0.2:
                    keys.insert(len(keys) // 2, pending[0])  # one still being written
                spec = m.prepare_load(keys)
                loads.append(keys)
                out.append(("load", spec.block_ids.tolist()))
            elif op == "unload" and loads:
                keys = loads.pop(rng.randrange(len(loads)))
                if rng.random() < 0.2:
                    keys = keys + keys[:1]  # listed more often than loaded
                m.complete_load(keys)
                out.append(("unload", len(keys)))
        except BlockStateError as e:
            out.append(("error", str(e)))
        out.append(deep_state(m, frozenset({"_mark", "_state_np", "_can_evict", "policy"})))
    return out


@pytest.mark.parametrize("seed", range(10))
def test_whole_call_pins_match_the_key_by_key_loop(seed, monkeypatch):
    monkeypatch.setattr(cpu_manager, "VECTOR_MIN", 32)  # the loads here: 10-100 keys
    vector = run_ops(seed)
    monkeypatch.setattr(cpu_manager, "VECTOR_MIN", 10**9)  # every call pins key by key
    assert run_ops(seed) == vector


def test_pins_past_a_byte_are_counted_beside_it():
    m = CPUOffloadingManager(4)
    keys = [key(0), key(1)]
    m.complete_store(m.prepare_store(keys).keys_to_store)
    for _ in range(MAX_PINS + 46):
        m.prepare_load(keys)
    m.prepare_load([key(0)] * 100)  # one call, a key listed 100 times: key by key
    s0, s1 = m.slot_of(key(0)), m.slot_of(key(1))
    assert m._state[s0] == m._state[s1] == MAX_PINS and m._state[s0] != PENDING
    assert m._more_pins == {s0: 146, s1: 46}
    assert m.prepare_store([key(2), key(3), key(4)]) is None  # pinned: nothing to evict
    before = deep_state(m)
    with pytest.raises(BlockStateError):
        m.complete_load([key(1)] * (MAX_PINS + 47))  # one more than loaded: nothing changes
    assert deep_state(m) == before
    for _ in range(MAX_PINS + 146):
        m.complete_load([key(0)])
    m.complete_load([key(1)] * (MAX_PINS + 46))
    assert m._state[s0] == m._state[s1] == 0 and not m._more_pins
    assert m.get_stats().gauges["pinned_blocks"] == 0
