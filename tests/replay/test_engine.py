"""The replay engine over the real CPU spec, on traces small enough to count by hand."""

from collections import OrderedDict

import numpy as np
import pytest

from kvoffload.config import ConfigError
from kvoffload.replay.engine import EngineOptions, ReplayEngine, VerificationError, replay
from kvoffload.replay.generator import generate_chat
from kvoffload.replay.oracle import simulate
from kvoffload.replay.traces import load_trace


def opts(cpu_blocks, **kw):
    """Legacy order by default: the trace README's reference semantics, so
    hit counts can be worked out by hand (test_vllm_order.py covers vLLM's)."""
    extra = {"num_cpu_chunks": cpu_blocks, "eviction_policy": kw.pop("policy", "lru")}
    extra.update(kw.pop("extra", {}))
    kw.setdefault("order", "legacy")
    return EngineOptions(extra_config=extra, progress=False, **kw)


def counts(r):
    c = r.counters
    return int(c["gpu_hit_blocks"]), int(c["offload_hit_blocks"]), int(c["block_refs"])


def check_tokens_add_up(r):
    c = r.counters
    assert c["gpu_hit_tokens"] + c["offload_hit_tokens"] + c["recomputed_tokens"] == c["prompt_tokens"]
    assert c["verify_failures"] == 0
    assert c["verified_blocks"] == c["offload_hit_blocks"]


def test_prefix_hits_with_room_for_everything(mooncake_file):
    # r1 reuses 1,2; r2 reuses 1; r3 reuses 1,2,3: 6 of 12 blocks
    tr = load_trace(mooncake_file([[1, 2, 3], [1, 2, 4], [1, 5], [1, 2, 3, 6]]), block_size=4)
    r = replay(tr, opts(100))
    assert counts(r) == (0, 6, 12)
    assert r.counters["offload_hit_tokens"] == 24 and r.counters["bytes_loaded"] == 6 * 4 * 16
    assert r.tiers["cpu"]["counters"]["stored_blocks"] == 6  # 1,2,3,4,5,6
    check_tokens_add_up(r)


def test_lru_eviction_by_hand(mooncake_file):
    # cap 3 (see test_oracle.test_lru_by_hand): 4 prefix hits of 10
    tr = load_trace(mooncake_file([[1, 2, 3], [1, 4], [1, 2, 3], [1, 4]]), block_size=4)
    r = replay(tr, opts(3))
    assert counts(r) == (0, 4, 10)
    assert r.counters["evicted_blocks"] == 3  # 3 (for 4), 4 (for 3), 3 again (for 4)
    check_tokens_add_up(r)


def test_gpu_prefix_cache_serves_first(mooncake_file):
    tr = load_trace(mooncake_file([[1, 2, 3], [1, 2, 4], [1, 5], [1, 2, 3, 6]]), block_size=4)
    big = replay(tr, opts(100, gpu_blocks=10))
    assert counts(big) == (6, 0, 12)
    # One idle GPU block: the head (1) survives, freed last; the rest comes
    # from the CPU tier: r1 loads 2, r3 loads 2,3.
    one = replay(tr, opts(100, gpu_blocks=1))
    assert counts(one) == (3, 3, 12)
    check_tokens_add_up(one)


def test_request_larger_than_the_tier_is_refused_not_fatal(mooncake_file):
    tr = load_trace(mooncake_file([[1, 2, 3, 4], [1, 2, 3, 4]]), block_size=4)
    r = replay(tr, opts(2))
    assert counts(r) == (0, 0, 8)
    assert r.counters["allocation_failures"] == 2


def test_first_500_mooncake_requests_match_an_independent_lru(mooncake_path):
    tr = load_trace(mooncake_path, limit=500)
    cap = 400
    # The simplest LRU of the same semantics: at arrival count the leading
    # resident run; touch the resident blocks (head most recent), store the
    # missing ones (evicting least recent), touch the resident ones again.
    lru: OrderedDict = OrderedDict()
    hits = 0
    for req in tr.requests:
        blocks = req.block_hashes
        n = 0
        while n < len(blocks) and blocks[n] in lru:
            n += 1
        hits += n
        resident = [b for b in blocks if b in lru]
        for b in reversed(resident):
            lru.move_to_end(b)
        for b in reversed(blocks):
            if b not in lru:
                if len(lru) == cap:
                    lru.popitem(last=False)
                lru[b] = True
        for b in reversed(resident):
            lru.move_to_end(b)
    r = replay(tr, opts(cap))
    assert hits > 0
    assert counts(r) == (0, hits, tr.num_block_refs)
    assert simulate([q.block_hashes for q in tr.requests], cap, "lru").prefix_hits == hits
    check_tokens_add_up(r)
    arc = replay(tr, opts(cap, policy="arc"))
    best = simulate([q.block_hashes for q in tr.requests], cap, "belady").prefix_hits
    assert arc.counters["offload_hit_blocks"] <= best and hits <= best


def test_decode_blocks_stored_only_when_asked():
    tr = generate_chat(seed=1, sessions=12, block_size=32)
    prompt_only = replay(tr, opts(5000))
    with_decode = replay(tr, opts(5000, extra={"offload_prompt_only": False}))
    assert prompt_only.options["offload_prompt_only"] and not with_decode.options["offload_prompt_only"]
    assert with_decode.counters["offload_hit_blocks"] > prompt_only.counters["offload_hit_blocks"]
    assert (with_decode.tiers["cpu"]["counters"]["stored_blocks"]
            > prompt_only.tiers["cpu"]["counters"]["stored_blocks"])
    check_tokens_add_up(with_decode)


def test_concurrent_requests_on_trace_time():
    tr = generate_chat(seed=2, sessions=30, block_size=32)
    r = replay(tr, opts(300, gpu_blocks=64, max_running=4, arrival="trace", time_compression=10.0))
    assert r.counters["requests"] == len(tr.requests)
    assert r.counters["gpu_hit_blocks"] > 0 and r.counters["offload_hit_blocks"] > 0
    assert r.counters["sim_time_ms"] >= tr.requests[-1].arrival_ms / 10.0
    check_tokens_add_up(r)


def _corrupt_after_stores(engine):
    """Scribble over every host-pool chunk as soon as a store lands."""
    real = engine.worker.get_finished

    def get_finished():
        results = real()
        if any(not engine._jobs[res.job_id].is_load for res in results if res.job_id in engine._jobs):
            engine.worker.pool.array[:, :8] ^= 0x5A
        return results

    engine.worker.get_finished = get_finished


def test_corrupt_bytes_are_caught_and_recomputed(mooncake_file, capsys):
    tr = load_trace(mooncake_file([[1, 2], [1, 2], [1, 3]]), block_size=4)
    engine = ReplayEngine(tr, opts(10))
    _corrupt_after_stores(engine)
    try:
        r = engine.run()
    finally:
        engine.close()
    assert r.counters["verify_failures"] == 3  # r1 loads 1,2; r2 loads 1
    assert r.counters["offload_hit_tokens"] == 0  # corrupt loads do not count as served
    assert r.counters["recomputed_tokens"] == r.counters["prompt_tokens"]
    assert "VERIFY FAILED" in capsys.readouterr().err
    strict = ReplayEngine(tr, EngineOptions(extra_config={"num_cpu_chunks": 10}, progress=False, strict=True))
    _corrupt_after_stores(strict)
    with pytest.raises(VerificationError, match="differ from what was stored"):
        try:
            strict.run()
        finally:
            strict.close()


def test_contents_depend_on_the_hash(mooncake_file):
    tr = load_trace(mooncake_file([[1, 2]]), block_size=4)
    engine = ReplayEngine(tr, opts(4))
    try:
        engine.run()
        gpu = engine.contents
        seeds = np.array([11, 12], dtype=np.int64)
        slots = np.array([0, 1])
        gpu.fill(slots, seeds)
        assert not len(gpu.check(slots, seeds))
        assert list(gpu.check(slots, seeds[::-1])) == [0, 1]
    finally:
        engine.close()


def test_bad_options_name_the_value(mooncake_file):
    tr = load_trace(mooncake_file([[1]]), block_size=4)
    with pytest.raises(ConfigError, match="'nope'"):
        replay(tr, opts(4, policy="nope"))
    with pytest.raises(ConfigError, match="multiple of 8"):
        replay(tr, opts(4, kv_bytes_per_token=3))
    with pytest.raises(ConfigError, match="unknown key 'bogus'"):
        replay(tr, opts(4, extra={"bogus": 1}))
    r = replay(tr, opts(4, policy="kvoffload.policies.lru:LRUPolicy"))
    assert r.counters["requests"] == 1


def test_policy_sees_one_insert_and_no_touch_of_fresh_blocks(mooncake_file):
    from kvoffload.policies import register_policy
    from kvoffload.policies.lru import LRUPolicy

    calls = []

    class Recording(LRUPolicy):
        name = "recording"

        def insert(self, keys, ctx):
            calls.append(("insert", ctx.req_id, list(keys)))
            super().insert(keys, ctx)

        def touch(self, keys, ctx):
            calls.append(("touch", ctx.req_id, list(keys)))
            super().touch(keys, ctx)

    register_policy("recording-test", Recording)
    tr = load_trace(mooncake_file([[1, 2], [1, 2, 3], [1, 2, 3]]), block_size=4)
    r = replay(tr, opts(10, policy="recording-test"))
    assert counts(r) == (0, 5, 8)
    inserted = {}
    for op, req, keys in calls:
        if op == "insert":
            assert not set(keys) & set(inserted), "a block was stored twice"
            inserted.update(dict.fromkeys(keys, req))
        else:  # a block is touched only by requests after the one that stored it
            assert all(inserted.get(k) != req for k in keys)
    assert len(inserted) == 3
    # keys reach the policy in prefix order, head first
    assert [k for op, req, keys in calls if op == "insert" and req == "0" for k in keys] == \
        [h.to_bytes(8, "big") + b"\0" * 4 for h in tr.requests[0].block_hashes]


def test_tiered_spec_serves_cpu_evictions_from_storage(mooncake_file, tmp_path):
    from kvoffload.replay.report import summary

    tr = load_trace(mooncake_file([[1, 2, 3], [4, 5, 6], [1, 2, 3]], block_size=64), block_size=64)
    o = opts(3, extra={"storage_dir": str(tmp_path / "kv"), "storage_bytes": "1MiB"}, sync_tiers=True)
    o.spec = "tiered"
    r = replay(tr, o)
    # r1 pushes 1,2,3 out of the CPU tier; r2 finds them in storage, waits
    # for a promotion (HIT_PENDING) and loads it, bytes checked. Promotions
    # hold at most half of CPU (1 of these 3 slots): r2 computes the rest.
    assert counts(r) == (0, 1, 9)
    assert r.counters["offload_hit_blocks_after_pending"] == 1 and r.counters["delayed_lookups"] >= 1
    assert r.counters["verified_blocks"] == 1 and r.counters["verify_failures"] == 0
    tiers = summary(r)["tiers"]
    assert set(tiers) >= {"cpu", "storage"}
    assert tiers["cpu"]["prefix_hit_rate"] == 0 and tiers["storage"]["prefix_hit_rate"] == 1 / 9


def test_blocks_promoted_by_look_ahead_are_credited_to_storage(mooncake_file, tmp_path):
    from kvoffload.replay.report import summary

    # r1 pushes 1,2,3 out of a 6-block CPU tier into storage; r2's lookup of 1
    # hits storage and its look-ahead promotes 2,3 in the same batch, so 2,3
    # answer HIT at once: all three came from storage, none from CPU.
    tr = load_trace(mooncake_file([[1, 2, 3], [4, 5, 6, 7, 8, 9], [1, 2, 3]], block_size=64), block_size=64)
    o = opts(6, extra={"storage_dir": str(tmp_path / "kv"), "storage_bytes": "1MiB"}, sync_tiers=True)
    o.spec = "tiered"
    r = replay(tr, o)
    assert counts(r) == (0, 3, 12)
    assert r.counters["offload_hit_blocks_after_pending"] == 1  # only the first answered HIT_PENDING
    assert r.counters["offload_hit_blocks_promoted"] == 3
    assert r.counters["verified_blocks"] == 3 and r.counters["verify_failures"] == 0
    s = summary(r)
    tiers = s["tiers"]
    assert tiers["storage"]["promoted_blocks"] == 3
    assert tiers["cpu"]["prefix_hit_rate"] == 0 and tiers["storage"]["prefix_hit_rate"] == 3 / 12
    assert tiers["cpu"]["lookup_hit_rate"] == tiers["cpu"]["hits"] / tiers["cpu"]["lookups"]


def _contents(verify):
    from kvoffload.replay.contents import BlockContents

    words = np.zeros((4, 64), dtype=np.int64)  # 4 blocks of 512 bytes
    contents = BlockContents(words, verify)
    slots, seeds = np.arange(4), np.array([5, 6, 7, 8], dtype=np.int64)
    contents.fill(slots, seeds)
    return words, contents, slots, seeds


@pytest.mark.parametrize("verify", ["sample", "all"])
def test_checks_catch_wrong_stale_and_torn_blocks(verify):
    words, contents, slots, seeds = _contents(verify)
    assert not len(contents.check(slots, seeds))
    words[1] = words[2]  # a block copied to the wrong slot
    words[3, 32:] = 0  # a block copied only in part (its tail never written)
    for _ in range(20):  # whichever words a sample takes
        assert contents.check(slots, seeds).tolist() == [1, 3]


def test_all_checks_every_byte_and_sample_moves_between_loads():
    words, every, slots, seeds = _contents("all")
    words[2, 17] ^= 1 << 40  # one flipped bit in the middle of one block
    assert every.check(slots, seeds).tolist() == [2]
    _, sample, _, _ = _contents("sample")
    sample.words[2, 17] ^= 1 << 40
    # the sample's middle words move from load to load: the flip is found within a few loads
    assert any(sample.check(slots, seeds).tolist() == [2] for _ in range(64))
    assert sample.words_checked(10) < every.words_checked(10) == 640


def test_verify_option_is_checked_and_reported(mooncake_file):
    from kvoffload.replay.report import format_table

    tr = load_trace(mooncake_file([[1, 2], [1, 2]]), block_size=4)
    with pytest.raises(ConfigError, match="verify.*'some'"):
        replay(tr, opts(8, verify="some"))
    for verify, said in (("all", "all bytes match"), ("sample", "--verify all checks every byte")):
        r = replay(tr, opts(8, verify=verify, kv_bytes_per_token=64))  # 32 words a block
        assert r.counters["verified_blocks"] == 2 and r.options["verify"] == verify
        assert said in format_table(r)


def test_manager_time_per_block_is_weighted_by_blocks():
    from kvoffload.replay.timing import TimedManager

    class Manager:  # stands for any manager: only the call's duration matters here
        def prepare_load(self, keys, ctx):
            return len(keys)

    timed = TimedManager(Manager())
    assert timed.ns_per_block() == {"p50": 0.0, "p99": 0.0, "mean": 0.0}
    timed.prepare_load([b"k"] * 999, None)
    timed.prepare_load([b"k"], None)
    timed.per_block[0], timed.per_block[1] = 1e-9, 1e-6  # 1 ns a block for 999 blocks, 1000 ns for one
    s = timed.ns_per_block()
    assert s["p50"] == pytest.approx(1.0) and s["p99"] == pytest.approx(1.0)
    assert s["mean"] == pytest.approx((999 + 1000) / 1000)
    assert timed.seconds > 0 and len(timed.blocks) == 2


def test_offload_keys_are_the_contracts_keys():
    from kvoffload.keys import make_offload_key
    from kvoffload.replay.contents import seeds_of
    from kvoffload.replay.scheduling import offload_keys

    hashes = [0, 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF]
    keys = offload_keys(seeds_of(hashes))
    assert keys == [make_offload_key(h.to_bytes(8, "big"), 0) for h in hashes]
    assert all(type(k) is bytes for k in keys) and offload_keys(seeds_of([])) == []


@pytest.mark.parametrize("kw", [
    dict(order="vllm", gpu_blocks=32, max_running=3),  # completions land a step later, however fast the copy
    dict(order="legacy"),  # one request at a time: its stores land before it finishes
], ids=["vllm", "legacy"])
def test_inline_copies_give_the_copy_threads_results(kw):
    # The default (copies in the step loop's thread) must replay exactly what
    # the worker's copy thread replays: every counter, every byte check.
    # (Legacy order with several requests running applies each job when the
    # thread happens to finish it: no run repeats itself there, so no test.)
    tr = generate_chat(seed=5, sessions=40, block_size=32)
    inline = replay(tr, opts(150, **kw))
    threaded = replay(tr, opts(150, copy_thread=True, **kw))
    assert inline.options["copies_inline"] and not threaded.options["copies_inline"]
    assert inline.counters["offload_hit_blocks"] > 0 and inline.counters["verified_blocks"] > 0
    # timings, and the legacy loop's idle turns while the thread copies (steps, each >= 1 simulated ms)
    skip = {"load_time_s", "store_time_s", "idle_waits", "steps", "sim_time_ms"}
    assert {k: v for k, v in inline.counters.items() if k not in skip} == \
        {k: v for k, v in threaded.counters.items() if k not in skip}
    assert inline.tiers == threaded.tiers
    check_tokens_add_up(inline)


@pytest.mark.parametrize("slots", [[3, 4, 5, 6], [9, 8, 7, 6, 5], [2], [1, 3, 4, 7], [5, 4, 6], [0, 0]],
                         ids=["up", "down", "one", "scattered", "turns", "repeated"])
def test_fill_writes_each_blocks_words_whatever_the_slot_order(slots):
    from kvoffload.replay.contents import BlockContents

    words = np.full((10, 16), -1, dtype=np.int64)
    contents = BlockContents(words, "all")
    s = np.array(slots, dtype=np.int64)
    seeds = np.arange(100, 100 + len(s), dtype=np.int64) * 7919
    contents.fill(s, seeds)
    last = dict(zip(slots, seeds))  # a slot listed twice holds its last block (fancy assignment's rule)
    for slot in range(10):
        want = contents._base + last[slot] if slot in last else np.full(16, -1)
        assert words[slot].tolist() == want.tolist()
    uniq = list(dict.fromkeys(reversed(slots)))
    assert not len(contents.check(np.array(uniq), np.array([last[x] for x in uniq])))


def test_keys_share_the_objects_of_the_last_request_with_the_same_head(mooncake_file):
    from kvoffload.replay.scheduling import offload_keys

    tr = load_trace(mooncake_file([[1, 2]]), block_size=4)
    engine = ReplayEngine(tr, opts(8))
    try:
        runs = [[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 9, 4], [1, 2], [7, 1, 2], [1, 2, 9, 4, 6], []]
        both = [engine._keys_sharing_prefix(np.array(r, dtype=np.int64)) for r in runs]
        got = [keys for keys, _ in both]
        for r, (keys, positions) in zip(runs, both):  # the contract's keys, whatever came before
            assert keys == offload_keys(np.array(r, dtype=np.int64))
            # and each key's end-token position, in key order (as built pair by pair)
            assert list(positions.items()) == [(k, 4 * (i + 1)) for i, k in enumerate(keys)]
        # a key listed twice: its last position (as a plain update gives)
        keys, positions = engine._keys_sharing_prefix(np.array([1, 2, 3, 2], dtype=np.int64))
        assert positions == {keys[0]: 4, keys[1]: 16, keys[2]: 12}
        keys, positions = engine._keys_sharing_prefix(np.array([1, 2, 5], dtype=np.int64))
        assert positions == {keys[0]: 4, keys[1]: 8, keys[2]: 12}
        assert all(a is b for a, b in zip(got[0], got[1][:3]))  # a longer turn reuses the objects
        assert got[2][1] is got[1][1] and got[2][2] is not got[1][2]  # up to where they differ
        # only the last request with that head is shared ([1, 2], not [1, 2, 9, 4])
        assert got[5][1] is got[3][1] and got[5][3] is not got[2][3]
    finally:
        engine.close()


def test_gpu_hands_out_the_lowest_free_slots_ascending():
    # a request's blocks lie in one stretch whenever the free slots allow, so fills and copies run over rows
    from kvoffload.replay.gpu import GPUBlocks

    gpu = GPUBlocks(8, 64, cache_blocks=0, shared=False)
    first = gpu.allocate(5)
    assert first.tolist() == [0, 1, 2, 3, 4]
    gpu.release([3, 0, 4])  # released in any order
    assert gpu.allocate(2).tolist() == [0, 3]
    assert gpu.allocate(4).tolist() == [4, 5, 6, 7]
    assert gpu.allocate(1) is None  # none left
    gpu.release([6, 1])
    assert gpu.allocate(2).tolist() == [1, 6]  # the lowest free, ascending, wherever they lie
