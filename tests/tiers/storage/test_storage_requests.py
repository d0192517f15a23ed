"""The storage manager and the requests whose stores it holds."""

from kvoffload.abstractions import CPULoadStoreSpec, LookupResult, ReqContext
from kvoffload.policies.lru import _Group
from storage_helpers import fill, key


def test_a_finished_request_leaves_no_running_group_behind(make_tier, pool):
    # The LRU keeps a group per running request (with its key positions); the storage
    # manager hears of the finish once the request's stores are in (tiering), and the group
    # must die then, or it lives, positions and all, while any of its keys stays on disk.
    tier = make_tier()
    mgr, worker = tier.get_manager(), tier.get_worker(pool)
    ks = [key(i) for i in range(4)]
    for c, k in enumerate(ks):
        fill(pool, c, k)
    ctx = ReqContext("r")
    ctx.set_offload_key_positions(ks, [16, 32, 48, 64])
    out = mgr.prepare_store(ks, ctx)
    worker.submit_store(1, CPULoadStoreSpec(list(range(4))), out.store_spec)
    worker.wait({1})
    assert all(r.success for r in worker.get_finished())
    mgr.complete_store(out.keys_to_store, ctx)

    def live():
        return [g for g in mgr.policy._order.values() if isinstance(g, _Group) and (g.live or g.positions)]

    assert live()  # running: the request's keys are ranked as its group
    mgr.on_request_finished(ctx)
    assert not live()
    assert [mgr.lookup(k, ctx) for k in ks] == [LookupResult.HIT] * 4  # the keys themselves stay
