"""The tiered spec: config keys and shorthands, and the real CPU worker
with a storage tier through the registered name."""

from __future__ import annotations

import pytest
import torch

from kvoffload.abstractions import ReqContext
from tiering_rig import END, HIT, PENDING, key

def _spec(tmp_path, cpu_chunks=2, **tier):
    from kvoffload.config import OffloadingConfig
    from kvoffload.spec import build_spec

    conf = {"type": "storage", "path": str(tmp_path / "kv"), "capacity_bytes": "1MiB", **tier}
    config = OffloadingConfig.from_dict({
        "groups": [{"tokens_per_block": 16}],
        "extra_config": {"num_cpu_chunks": cpu_chunks, "kv_bytes_per_chunk": 2 * 8192,
                         "namespace": {"model": "tiny"}, "secondary_tiers": [conf]},
    })
    return build_spec("tiered", config)


def _run_job(worker, submit, *args):
    assert submit(*args)
    worker.wait({args[0]})
    assert all(r.success for r in worker.get_finished())


def test_spec_gpu_to_storage_and_back_after_restart(tmp_path):
    from kvoffload.abstractions import CPULoadStoreSpec, GPULoadStoreSpec
    from kvoffload.kv_caches import random_kv_caches

    tensors, caches = random_kv_caches(8, [8192, 8192])
    spec = _spec(tmp_path, cpu_chunks=4)  # (promotions hold at most half of it)
    mgr, worker = spec.get_manager(), spec.get_worker(caches)
    ctx = ReqContext("r")
    mgr.on_new_request(ctx)
    keys = [key(i) for i in range(6)]
    for i, k in enumerate(keys):  # CPU holds 4: the first two leave CPU, stay in storage
        out = mgr.prepare_store([k], ctx)
        _run_job(worker, worker.submit_store, 10 + i, GPULoadStoreSpec([i]), out.store_spec)
        mgr.complete_store(out.keys_to_store, ctx)
        mgr.on_schedule_end(END)
        mgr.wait_idle()
    original = [t[:4].clone() for t in tensors]
    mgr.shutdown()
    worker.shutdown()

    spec2 = _spec(tmp_path, cpu_chunks=4)  # a new engine on the same directory
    mgr2, worker2 = spec2.get_manager(), spec2.get_worker(caches)
    for t in tensors:
        t.zero_()
    ctx = ReqContext("s")
    mgr2.on_new_request(ctx)
    assert [mgr2.lookup(k, ctx) for k in keys[:2]] == [PENDING, PENDING]
    mgr2.on_schedule_end(END)
    mgr2.wait_idle()
    assert [mgr2.lookup(k, ctx) for k in keys[:2]] == [HIT, HIT]
    src = mgr2.prepare_load(keys[:2], ctx)
    assert isinstance(src, CPULoadStoreSpec)
    _run_job(worker2, worker2.submit_load, 99, src, GPULoadStoreSpec([0, 1]))
    mgr2.complete_load(keys[:2], ctx)
    for t, o in zip(tensors, original):
        assert torch.equal(t[:2], o[:2])
    mgr2.shutdown()
    worker2.shutdown()


def test_spec_config_errors_name_the_key(tmp_path):
    from kvoffload.config import ConfigError

    with pytest.raises(ConfigError, match="store_threshold"):
        _spec(tmp_path, store_threshold=0)
    with pytest.raises(ConfigError, match="capacity_bytes"):
        _spec(tmp_path, capacity_bytes="lots")
    with pytest.raises(ConfigError, match="unknown key 'pth'"):
        _spec(tmp_path, pth="x")
    with pytest.raises(ConfigError, match="unknown secondary tier type 'tape'"):
        _spec(tmp_path, type="tape")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="file"):
        _spec(tmp_path, path=str(tmp_path / "file" / "kv"))


def test_spec_storage_shorthand(tmp_path):
    from kvoffload.config import ConfigError, OffloadingConfig
    from kvoffload.spec import build_spec

    def cfg(**extra):
        return OffloadingConfig.from_dict({"groups": [16], "extra_config": {
            "num_cpu_chunks": 2, "kv_bytes_per_chunk": 8192, **extra}})

    spec = build_spec("tiered", cfg(storage_dir=str(tmp_path / "kv"), storage_bytes="64KiB"))
    (tier,) = spec.get_manager().tiers
    assert tier.name == "storage" and tier.manager.get_stats().gauges["capacity_blocks"] == 8
    spec.get_manager().shutdown()
    with pytest.raises(ConfigError, match="storage_dir and storage_bytes"):
        build_spec("tiered", cfg(storage_dir=str(tmp_path / "kv2")))




def test_admission_names_a_filter_of_tiering_admission(tmp_path):
    from kvoffload.config import ConfigError
    from kvoffload.tiering.admission import StoreCountAdmission, TinyLFUAdmission

    def admission(**conf):
        spec = _spec(tmp_path, **conf)
        try:
            (tier,) = spec.get_manager().tiers
            return tier.admission
        finally:
            spec.get_manager().shutdown()

    assert admission() is None  # the default: every chunk CPU stores is written down
    assert admission(store_threshold=3).threshold == 3  # the shorthand: a store count
    assert isinstance(admission(store_threshold=3), StoreCountAdmission)
    f = admission(admission="tinylfu", store_threshold=4)
    assert isinstance(f, TinyLFUAdmission) and f.threshold == 4
    assert isinstance(admission(admission="store_count"), StoreCountAdmission)
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.admission: unknown admission filter 'lfu'"):
        _spec(tmp_path, admission="lfu")
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.admission"):
        _spec(tmp_path, admission=["tinylfu"])
