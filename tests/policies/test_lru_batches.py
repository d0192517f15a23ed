"""LRU's C-level paths for large batches (BATCH_MIN keys and more: moves in
one C loop, evicting the n oldest loose keys at once) end in the same state
and pick the same victims as its key-by-key paths."""

from __future__ import annotations

import random

import pytest

from kvoffload.abstractions import ReqContext
from kvoffload.policies import lru
from kvoffload.policies.lru import LRUPolicy


SIZES = [3, lru.BATCH_MIN - 1, lru.BATCH_MIN, 150]  # around the threshold, read once


def run_ops(seed: int) -> list:
    """A random run of inserts, accesses, touches, refreshes and evictions
    over batches around BATCH_MIN keys; what it evicts and the final order."""
    rng = random.Random(seed)
    pol = LRUPolicy(4000)
    held: list[bytes] = []
    out = []
    nxt = 0
    ctxs = []
    for step in range(60):
        op = rng.choice(["insert", "insert", "access", "touch", "refresh", "evict", "finish"])
        n = rng.choice(SIZES)
        if op == "insert" or not held:
            keys = [i.to_bytes(8, "big") for i in range(nxt, nxt + n)]
            nxt += n
            ctx = None
            if rng.random() < 0.5:
                ctx = ReqContext(f"r{step}")
                ctx.set_offload_key_positions(keys, range(1, n + 1))
                ctxs.append((ctx, keys))
            pol.insert(keys, ctx)
            held += keys
            continue
        some = rng.sample(held, min(n, len(held)))
        if rng.random() < 0.3:
            some[len(some) // 2] = b"gone" + some[0]  # one key the policy does not hold
        if op in ("access", "finish") and ctxs:
            ctx, keys = rng.choice(ctxs)
            if op == "access":
                pol.access([k for k in keys if k in pol] or keys, ctx)
            else:
                pol.refresh([k for k in keys if k in pol], ctx)
        elif op == "touch":
            pol.touch(some, None)
        elif op == "refresh":
            pol.refresh(some, None)
        elif op == "evict":
            victims = pol.evict(min(n, len(held)), lambda k: k[-1] % 7 != 0)
            out.append(victims)
            if victims:
                gone = set(victims)
                held = [k for k in held if k not in gone]
    out.append([(k, None if g is None else (g.live, g._head_first())) for k, g in pol._order.items()])
    return out


@pytest.mark.parametrize("seed", range(12))
def test_batched_paths_match_the_key_by_key_paths(seed, monkeypatch):
    batched = run_ops(seed)
    monkeypatch.setattr(lru, "BATCH_MIN", 10**9)  # every call takes the key-by-key path
    assert run_ops(seed) == batched
