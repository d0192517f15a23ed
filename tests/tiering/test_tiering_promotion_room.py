"""What the tiers below learn of reuse served from CPU, and how promotions
share the half of CPU they may hold: a real CPU manager, host pool and
storage tier on files (tiering_rig)."""

from __future__ import annotations

from tiering_rig import END, HIT, MISS, PENDING, key


def _positions(ctx, keys):
    for pos, k in enumerate(keys):
        ctx.set_offload_key_position(k, (pos + 1) * 16)


def _two_requests_below_cpu(r):
    """Requests a and b, each with a prefix of 3 chunks storage holds and CPU lacks."""
    w = r.request("w")
    a_keys, b_keys = [key(i) for i in range(3)], [key(i) for i in range(10, 13)]
    r.in_storage_only(w, a_keys + b_keys, [key(i) for i in range(20, 28)])
    a, b = r.request("a"), r.request("b")
    _positions(a, a_keys)
    _positions(b, b_keys)
    return a, a_keys, b, b_keys


def test_reuse_served_from_cpu_keeps_the_block_below_recent(rig):
    """vLLM's scheduler calls no touch(): a block reused from CPU is ranked
    by its loads. The tiers below hold it too and must see that reuse, or
    their LRU is a FIFO that drops the hottest blocks first (the Mooncake
    trace at CPU 1% + storage 25% lost 8% of its hits to it)."""
    r = rig(cpu_chunks=2, storage_slots=4)
    w = r.request("w")
    k = [key(i) for i in range(5)]
    r.gpu_store([k[0]], w)
    r.settle()
    r.gpu_store([k[1]], w)
    r.settle()
    u = r.request("u")  # k0, the oldest in storage, is served from CPU
    r.mgr.prepare_load([k[0]], u)
    r.mgr.complete_load([k[0]], u)
    r.mgr.on_request_finished(u)
    for i in (2, 3, 4):  # storage fills (4 slots), then evicts its least recent
        r.gpu_store([k[i]], w)
        r.settle()
    sm = r.storage.get_manager()
    assert sm.lookup(k[0], w) is HIT
    assert sm.lookup(k[1], w) is MISS


def test_two_prefixes_that_do_not_fit_together_each_arrive_whole(rig):
    """Promotions may hold half of CPU (4 of 8 here). Two requests want 3
    blocks each from storage: the second waits until the first has loaded,
    then gets all 3. It used to take the 1 slot left and then be refused the
    rest (a MISS: recomputed although storage held it)."""
    r = rig(cpu_chunks=8)
    a, a_keys, b, b_keys = _two_requests_below_cpu(r)
    assert r.mgr.lookup(a_keys[0], a) is PENDING
    assert r.mgr.lookup(b_keys[0], b) is PENDING
    r.settle()
    assert [r.mgr.lookup(k, a) for k in a_keys] == [HIT] * 3
    assert r.mgr.lookup(b_keys[0], b) is PENDING  # b holds nothing: it waits for room
    r.settle()
    assert r.mgr.lookup(b_keys[0], b) is PENDING
    r.mgr.prepare_load(a_keys, a)
    r.mgr.complete_load(a_keys, a)
    assert r.mgr.lookup(b_keys[0], b) is PENDING
    r.settle()
    assert [r.mgr.lookup(k, b) for k in b_keys] == [HIT] * 3
    assert r.mgr.get_stats().children[1].counters.get("promotion_failures", 0) == 0


def test_one_holder_waits_for_the_rest_of_its_prefix_the_others_go_ahead(rig):
    """With promotions' half of CPU full, one request that holds part of its
    prefix (the waiter) waits for the rest; another holder is refused (MISS)
    and goes ahead, so its room returns and the waiter's promotion finds it.
    Both waiting would wait for each other."""
    r = rig(cpu_chunks=8)
    w = r.request("w")
    a_keys, c_keys, late = [key(0), key(1)], [key(10), key(11)], key(2)
    filler = iter(range(100, 200))
    r.in_storage_only(w, a_keys + c_keys, [key(next(filler)) for _ in range(8)])
    a, c = r.request("a"), r.request("c")
    _positions(a, a_keys + [late])
    _positions(c, c_keys + [key(12)])
    assert r.mgr.lookup(a_keys[0], a) is PENDING  # a's run stops at key 2: storage lacks it yet
    assert r.mgr.lookup(c_keys[0], c) is PENDING
    r.settle()
    assert r.mgr.promotions.holding == 4  # a and c hold 2 each: the half is full
    # keys 2 and 12 reach storage (and leave CPU) only now
    r.in_storage_only(w, [late, key(12)], [key(next(filler)) for _ in range(4)])
    assert [r.mgr.lookup(k, a) for k in a_keys + [late]] == [HIT, HIT, PENDING]  # a asks first: the waiter
    assert [r.mgr.lookup(k, c) for k in c_keys + [key(12)]] == [HIT, HIT, MISS]  # c goes ahead
    r.mgr.prepare_load(c_keys, c)
    r.mgr.complete_load(c_keys, c)
    r.mgr.on_request_finished(c)
    assert r.mgr.lookup(late, a) is PENDING  # asked again (the next step): room now, queued
    r.settle()
    assert [r.mgr.lookup(k, a) for k in a_keys + [late]] == [HIT] * 3
    assert r.mgr.get_stats().children[1].counters.get("promotion_failures", 0) == 0


def test_a_request_that_waited_long_enough_takes_a_part(rig):
    """Waiting for room for all of its chunks is bounded: after PATIENCE
    steps asking, a request holding nothing takes the room there is."""
    from kvoffload.tiering.promotion import PATIENCE

    r = rig(cpu_chunks=8)
    a, a_keys, b, b_keys = _two_requests_below_cpu(r)
    assert r.mgr.lookup(a_keys[0], a) is PENDING
    r.settle()  # a holds 3 of the 4 promotions may hold, and never loads them here
    for _ in range(PATIENCE):
        assert r.mgr.lookup(b_keys[0], b) is PENDING
        r.settle()
        assert r.cpu.slot_of(b_keys[0]) is None  # still waiting for room for all 3
    assert r.mgr.lookup(b_keys[0], b) is PENDING
    r.settle()
    assert r.mgr.lookup(b_keys[0], b) is HIT  # a part: the one slot left
    assert r.mgr.promotions.holding == 4


class StuckLoads:
    """A tier worker whose loads do not finish while `stuck` is set (a
    Mooncake node that stopped answering: its transfers queue for seconds)."""

    def __init__(self, inner):
        self.inner, self.stuck, self._loads, self._held = inner, True, set(), []

    def submit_store(self, job_id, src, dst):
        return self.inner.submit_store(job_id, src, dst)

    def submit_load(self, job_id, src, dst):
        self._loads.add(job_id)
        return self.inner.submit_load(job_id, src, dst)

    def get_finished(self):
        done = self._held + list(self.inner.get_finished())
        self._held = [d for d in done if self.stuck and d.job_id in self._loads]
        return [d for d in done if d not in self._held]

    def wait(self, job_ids):
        self.inner.wait(job_ids)

    def shutdown(self):
        self.inner.shutdown()


def test_a_request_stops_waiting_for_a_late_promotion(rig):
    """A promotion in flight past promotion_deadline_s: the request's lookup
    answers MISS, so it computes instead of waiting for a stuck tier; once
    the promotion lands, the block is served."""
    r = rig(cpu_chunks=4, worker_wrap=StuckLoads)
    r.mgr.promotion_deadline_s = 10.0
    r.in_storage_only(r.request("w"), [key(0)], [key(i) for i in range(20, 24)])
    a = r.request("a")
    assert r.mgr.lookup(key(0), a) is PENDING
    r.mgr.on_schedule_end(END)  # submitted; the worker holds it
    r.mgr.wait_idle()
    assert r.mgr.lookup(key(0), a) is PENDING  # within the deadline
    r.mgr._requests["a"].promote_since -= 11.0  # (as if 11 s went by)
    assert r.mgr.lookup(key(0), a) is MISS
    assert r.mgr.get_stats().counters["promotion_timeouts"] == 1
    r.tier.worker.stuck = False
    r.settle()
    assert r.mgr.lookup(key(0), a) is HIT  # it landed after all: served to whoever asks
