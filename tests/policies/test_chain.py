"""The `chain` policy's rules, through the CPU manager (as vLLM drives it)."""

import pytest

from kvoffload.abstractions import LookupResult, ReqContext
from kvoffload.keys import make_offload_key
from kvoffload.policies.chain import F_STEP, ChainPolicy
from kvoffload.tiers.cpu.manager import CPUOffloadingManager


def keys(conv: int, n: int) -> list[bytes]:
    return [make_offload_key(conv.to_bytes(2, "big") + i.to_bytes(4, "big"), 0) for i in range(n)]


def turn(m: CPUOffloadingManager, prompt: list[bytes], step: int = 4, params=None) -> int:
    """One request: lookups to the first miss, load the hits, store the rest
    in steps, finish. Returns its prefix hits."""
    ctx = ReqContext("r", kv_transfer_params=params)
    for i, k in enumerate(prompt):
        ctx.set_offload_key_position(k, (i + 1) * 64)
    m.on_new_request(ctx)
    n = 0
    for k in prompt:
        if m.lookup(k, ctx) is not LookupResult.HIT:
            break
        n += 1
    if n:
        m.prepare_load(prompt[:n], ctx)
        m.complete_load(prompt[:n], ctx)
    rest = prompt[n:]
    for a in range(0, len(rest), step):
        out = m.prepare_store(rest[a:a + step], ctx)
        if out is not None and out.keys_to_store:
            m.complete_store(out.keys_to_store, ctx)
    m.on_request_finished(ctx)
    return n


def test_a_context_larger_than_the_cache_keeps_its_head():
    """LRU's loop pathology: every turn re-reads a growing context larger
    than the cache. LRU (as vLLM 0.33's: a running request's reads rank with
    its stores, tail first) keeps only part of the head; chain keeps the
    head and refuses the tail."""
    hits = {}
    for policy in ("lru", "chain"):
        m = CPUOffloadingManager(10, policy)
        hits[policy] = [turn(m, keys(0, 12 + 4 * t)) for t in range(6)]
    assert hits["chain"] == [0] + [10] * 5
    assert sum(hits["lru"]) < sum(hits["chain"]), hits["lru"]


def test_a_store_never_evicts_its_own_prefix_and_stops_at_the_first_refusal():
    m = CPUOffloadingManager(6, "chain")
    prompt = keys(0, 10)
    ctx = ReqContext("r")
    for i, k in enumerate(prompt):
        ctx.set_offload_key_position(k, (i + 1) * 64)
    out = m.prepare_store(prompt[:4], ctx)
    m.complete_store(out.keys_to_store, ctx)
    out = m.prepare_store(prompt[4:8], ctx)
    assert out.keys_to_store == prompt[4:6] and out.evicted_keys == []  # a head of the new keys
    m.complete_store(out.keys_to_store, ctx)
    out = m.prepare_store(prompt[8:], ctx)
    assert out.keys_to_store == []  # after the hole: useless
    assert all(k in m for k in prompt[:6])


def test_conversations_that_together_outgrow_the_cache_share_it():
    """Two conversations alternate, each context alone about the cache's size:
    LRU lets each evict the other and both miss; chain keeps what each has."""
    result = {}
    for policy in ("lru", "chain"):
        m = CPUOffloadingManager(16, policy)
        got = []
        for t in range(8):
            for conv in (0, 1):
                got.append(turn(m, keys(conv, 12 + 2 * t)))
        result[policy] = sum(got[4:])
    assert result["lru"] * 10 <= result["chain"]  # LRU: almost nothing (its running request's own reads survive)
    assert result["chain"] >= 16 * 5  # the whole cache serves hits every round


def test_a_chain_idle_longer_than_the_requests_interval_is_evicted():
    """A conversation that stopped coming back gives way to a live one."""
    m = CPUOffloadingManager(8, "chain")
    turn(m, keys(9, 4))  # comes once, never again
    for t in range(6):
        turn(m, keys(0, 4 + t))  # comes every request
    assert not any(k in m for k in keys(9, 4))
    assert all(k in m for k in keys(0, 8))


def test_f_learns_from_what_each_side_gave_up():
    pol = ChainPolicy(4)
    f = pol.f
    pol._refused[b"r" * 12] = None
    pol._learn(b"r" * 12)  # a refused key came back as a request's first miss
    assert pol.f == f - F_STEP
    pol._evicted[b"e" * 12] = None
    pol._learn(b"e" * 12)  # so did an evicted one
    assert pol.f == f
    pol._learn(b"x" * 12)  # in neither ghost: no evidence
    assert pol.f == f


@pytest.mark.parametrize("name", ["chain", "segchain"])
def test_without_a_context_it_evicts_like_lru(name):
    victims = {}
    for policy in ("lru", name):
        m = CPUOffloadingManager(4, policy)
        for i in range(6):
            k = keys(i, 1)
            out = m.prepare_store(k, None)
            m.complete_store(out.keys_to_store, None)
            if i == 3:
                m.touch(keys(0, 1), None)
        victims[policy] = sorted(k for i in range(6) for k in keys(i, 1) if k not in m)
    assert victims[name] == victims["lru"]


@pytest.mark.parametrize("name", ["chain", "segchain"])
def test_low_retention_blocks_go_first(name):
    m = CPUOffloadingManager(8, name)
    turn(m, keys(0, 4))
    turn(m, keys(1, 4), params={"kv_retention": "low"})
    turn(m, keys(2, 4))
    assert all(k in m for k in keys(0, 4)) and all(k in m for k in keys(2, 4))
    assert not any(k in m for k in keys(1, 4))
