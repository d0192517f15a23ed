"""What reaches the CPU tier and the tiers below, over a real CPU manager,
host pool and storage tier on files: head stores of offers larger than
CPU's room, admission filters, and back-pressure (cascades bounded, the
rest waiting, every loss counted)."""

from __future__ import annotations

from tiering_rig import HIT, MISS, LateReports, QueueFull, key


def test_store_threshold_writes_only_reused_chunks(rig):
    r = rig(store_threshold=2)
    ctx = r.request()
    r.gpu_store([key(0), key(1)], ctx)
    r.settle()
    sm = r.storage.get_manager()
    assert sm.lookup(key(0), ctx) is MISS  # offered once
    r.mgr.touch([key(0)], ctx)  # reused while resident in CPU: written now
    r.settle()
    assert sm.lookup(key(0), ctx) is HIT
    assert sm.lookup(key(1), ctx) is MISS


def test_a_load_from_cpu_is_the_reuse_admission_counts(rig):
    """vLLM calls no touch(): a chunk reused from CPU is loaded, and that
    load is its second offer, so a tier with store_threshold 2 writes it
    down then. (Counted only on touch, nothing reused from CPU ever reached
    such a tier under vLLM.)"""
    r = rig(store_threshold=2)
    ctx = r.request()
    r.gpu_store([key(0), key(1)], ctx)
    r.settle()
    sm = r.storage.get_manager()
    other = r.request("reuse")
    r.mgr.prepare_load([key(0)], other)
    r.mgr.complete_load([key(0)], other)
    r.settle()
    assert sm.lookup(key(0), ctx) is HIT
    assert sm.lookup(key(1), ctx) is MISS


def test_tinylfu_admission_writes_only_reused_chunks(rig):
    from kvoffload.tiering.admission import TinyLFUAdmission

    r = rig(admission=TinyLFUAdmission(threshold=2, prefix_closed=False))
    ctx = r.request()
    r.gpu_store([key(0), key(1)], ctx)
    r.settle()
    sm = r.storage.get_manager()
    assert sm.lookup(key(0), ctx) is MISS  # offered once
    r.mgr.touch([key(0)], ctx)  # reused while resident in CPU: admitted, written now
    r.settle()
    assert sm.lookup(key(0), ctx) is HIT
    assert sm.lookup(key(1), ctx) is MISS
    r.mgr.touch([key(0)], ctx)  # admitted before: not written again
    r.settle()
    assert r.mgr.get_stats().children[1].counters["cascaded_blocks"] == 1


def test_back_pressure_defers_writes_down_and_counts(rig):
    """A tier with max_queue_depth chunks in flight: the rest wait, in
    order, and are written down as its jobs finish; none is dropped. (The
    worker reports a job one poll late, so what get_stats sees does not
    depend on its threads' timing.)"""
    r = rig(cpu_chunks=8, max_queue_depth=2, worker_wrap=LateReports)
    ctx = r.request()
    keys = [key(i) for i in range(4)]
    r.gpu_store(keys, ctx)  # 4 chunks > depth 2: two wait
    s = r.mgr.get_stats().children[1]  # (counters since the last get_stats)
    assert s.counters["cascaded_blocks"] == 2 and s.counters["cascade_deferred"] == 2
    assert s.gauges["cascade_waiting"] == 2 and r.mgr.has_pending_work()
    r.settle()
    s = r.mgr.get_stats().children[1]
    assert s.counters["cascaded_blocks"] == 2 and "dropped_stores" not in s.counters
    assert s.gauges["cascade_waiting"] == 0 and s.gauges["queue_depth"] == 0
    assert [r.storage.get_manager().lookup(k, ctx) for k in keys] == [HIT] * 4
    assert r.cpu.get_stats().gauges["pinned_blocks"] == 0


def test_cascades_in_flight_pin_at_most_a_quarter_of_cpu(rig):
    """Cascades pin their CPU copies until the write lands: whatever a tier's
    max_queue_depth, they pin at most a quarter of CPU, so the engine's
    stores find room while a slow tier catches up."""
    r = rig(cpu_chunks=8, max_queue_depth=256, worker_wrap=LateReports)
    ctx = r.request()
    r.gpu_store([key(i) for i in range(8)], ctx)  # CPU full; all 8 to be written down
    assert r.cpu.get_stats().gauges["pinned_blocks"] == 2  # 8 // 4 in flight, 6 wait
    out = r.mgr.prepare_store([key(i) for i in range(10, 16)], ctx)  # the unpinned six make room
    assert out is not None and len(out.keys_to_store) == 6
    r.mgr.complete_store(out.keys_to_store, ctx)
    r.settle()
    s = r.mgr.get_stats().children[1]
    # keys 2..7 left CPU before their turn: counted, not written, not silent
    assert s.counters["cascade_missed"] == 6 and "dropped_stores" not in s.counters
    assert s.counters["cascaded_blocks"] == 2 + 6  # keys 0, 1 and the six new ones
    assert s.counters["cascade_deferred"] == 6 + 6
    sm = r.storage.get_manager()
    assert [sm.lookup(key(i), ctx) for i in (0, 1, 10, 15)] == [HIT] * 4
    assert sm.lookup(key(2), ctx) is MISS


class _HeldReports(LateReports):
    """A worker that reports nothing while `holding` is set."""

    def __init__(self, inner):
        super().__init__(inner, late=False)
        self.holding = True

    def get_finished(self):
        return [] if self.holding else super().get_finished()


def test_wait_idle_returns_when_a_worker_holds_its_reports(rig):
    """Keys waiting behind jobs a worker does not report yet: wait_idle gives
    up after rounds that change nothing (no hang at a reset or shutdown);
    they are written down once the reports come."""
    r = rig(cpu_chunks=8, worker_wrap=_HeldReports)
    ctx = r.request()
    keys = [key(i) for i in range(4)]
    r.gpu_store(keys, ctx)  # 2 in flight, 2 waiting
    r.mgr.wait_idle()
    assert len(r.tier.waiting) == 2
    r.tier.worker.holding = False
    r.settle()
    assert not r.tier.waiting and r.tier.in_flight == 0
    assert [r.storage.get_manager().lookup(k, ctx) for k in keys] == [HIT] * 4


def test_a_full_wait_queue_lets_its_oldest_key_go_and_counts_it(rig):
    """A tier's wait queue holds at most CPU's slot count of keys: a new key
    past it lets the oldest go, counted missed if it left CPU already,
    else dropped."""
    r = rig(cpu_chunks=4, worker_wrap=LateReports)
    ctx = r.request()
    r.gpu_store([key(0)], ctx)  # in flight: 4 // 4 = 1, the most cascades may pin
    for i in (1, 2, 3):
        r.gpu_store([key(i)], ctx)  # each waits
    r.mgr.touch([key(1)], ctx)  # key 1 recent: LRU evicts 2, then 3
    r.gpu_store([key(4)], ctx)  # evicts key 2; the queue is full (1, 2, 3, 4)
    r.gpu_store([key(5)], ctx)  # evicts key 3; key 1, oldest in the queue and still in CPU, goes
    s = r.mgr.get_stats().children[1]
    assert s.counters["cascade_deferred"] == 5 and s.counters["dropped_stores"] == 1
    r.settle()
    s = r.mgr.get_stats().children[1]
    assert s.counters["cascade_missed"] == 2 and s.counters["cascaded_blocks"] == 2  # keys 4, 5
    sm = r.storage.get_manager()
    assert [sm.lookup(key(i), ctx) for i in range(6)] == [HIT, MISS, MISS, MISS, HIT, HIT]


def test_writes_a_full_worker_refuses_wait_and_land_once_it_has_room(rig):
    """A remote tier's worker refuses stores past its queue (a slow server):
    those writes wait at the head of the tier's queue, are tried again as
    steps go by, and land once it takes them; none is dropped. wait_idle()
    returns while it refuses (no round changes anything)."""
    r = rig(cpu_chunks=8, worker_wrap=QueueFull)
    ctx = r.request()
    keys = [key(i) for i in range(3)]
    r.gpu_store(keys, ctx)
    r.settle()
    r.settle()
    s = r.mgr.get_stats().children[1]
    assert r.tier.worker.refused >= 2 and "dropped_stores" not in s.counters
    assert s.gauges["cascade_waiting"] == 3 and r.cpu.get_stats().gauges["pinned_blocks"] == 0
    r.tier.worker.full = False
    r.settle()
    s = r.mgr.get_stats().children[1]
    assert s.counters["cascaded_blocks"] == 3 and s.gauges["cascade_waiting"] == 0
    assert [r.storage.get_manager().lookup(k, ctx) for k in keys] == [HIT] * 3


def test_an_offer_larger_than_cpu_stores_its_head(rig):
    """vLLM's connector offers a request's new blocks each step and, refused,
    offers them again with the next step's added: a prompt larger than CPU
    would be refused to its end and reach no tier. The tiered manager
    stores the head that fits (the engine moves past the rest)."""
    r = rig(cpu_chunks=4)
    ctx = r.request()
    keys = [key(i) for i in range(6)]
    out = r.mgr.prepare_store(keys, ctx)
    assert out.keys_to_store == keys[:4]
    r.mgr.complete_store(out.keys_to_store, ctx)
    r.settle()  # cascaded: storage has the head
    assert [r.storage.get_manager().lookup(k, ctx) for k in keys] == [HIT] * 4 + [MISS] * 2
    assert r.mgr.get_stats().counters["partial_stores"] == 1
    assert r.cpu.prepare_store([key(i) for i in range(10, 16)], ctx) is None  # the CPU tier alone refuses


def test_an_offer_headed_by_held_keys_stores_the_head_of_its_new_keys(rig):
    """The head cut counts room against the offer's new keys: its held keys
    (here pinned, loaded by the request) took the whole room when it was cut
    from the offer's start, so nothing was stored and the empty answer told
    vLLM to move past six new blocks for good. Now the head of the new keys
    is stored and the rest counted (store_blocks_cut); with no room for any
    new key the answer is None (offered again)."""
    r = rig(cpu_chunks=6)
    ctx = r.request()
    held = [key(i) for i in range(4)]
    r.gpu_store(held, ctx)
    r.settle()
    r.mgr.prepare_load(held, ctx)  # the request loaded its prefix: pinned
    new = [key(i) for i in range(4, 10)]
    out = r.mgr.prepare_store(held + new, ctx)
    assert out is not None and out.keys_to_store == new[:2]
    assert r.mgr.get_stats().counters["store_blocks_cut"] == 4
    assert r.mgr.prepare_store(held + [key(20)], ctx) is None  # every slot pinned or being written
    r.mgr.complete_store(out.keys_to_store, ctx)
    r.mgr.complete_load(held, ctx)
