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


def test_promotion_deadline_s_is_seconds_or_none(tmp_path):
    from kvoffload.config import ConfigError, OffloadingConfig
    from kvoffload.spec import build_spec

    def spec(*value):
        config = OffloadingConfig.from_dict({
            "groups": [{"tokens_per_block": 16}],
            "extra_config": {"num_cpu_chunks": 2, "kv_bytes_per_chunk": 4096, "storage_dir": str(tmp_path / "kv"),
                             "storage_bytes": "1MiB", **({"promotion_deadline_s": value[0]} if value else {})}})
        return build_spec("tiered", config)

    default = spec()
    assert default.promotion_deadline_s == 2.0  # users get one unless they say otherwise
    manager = default.get_manager()
    try:
        assert manager.promotion_deadline_s == 2.0
    finally:
        manager.shutdown()
    assert spec(0.5).promotion_deadline_s == 0.5
    assert spec(0).promotion_deadline_s is None and spec(None).promotion_deadline_s is None
    for bad in (-1, "2s", True, float("nan")):
        with pytest.raises(ConfigError, match="promotion_deadline_s"):
            spec(bad)


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


# ---- disk: one namespace directory, nothing left by a failed start ---------

HERE = __import__("pathlib").Path(__file__).parent


def _ns_dirs(root) -> dict[str, list[str]]:
    """ns-* directory -> its files, under a storage path (empty if none)."""
    import os

    if not os.path.isdir(root):
        return {}
    return {d: sorted(os.listdir(os.path.join(root, d))) for d in os.listdir(root) if d.startswith("ns-")}


def _canonical_spec(tmp_path):
    """A tiered spec and KV caches of whole canonical pages: the tiers'
    namespace turns out "agnostic" only once get_worker() sees them."""
    import sys

    sys.path.insert(0, str(HERE.parent / "layout"))
    from layout_ref import canonical_kv_caches, full_cache

    from kvoffload.config import OffloadingConfig
    from kvoffload.layout import LayerLayout, ParallelLayout
    from kvoffload.tiering import TieredOffloadingSpec

    layer, par = LayerLayout(16, 2, 32, torch.float16), ParallelLayout(0, 1)
    kv = canonical_kv_caches([(full_cache(layer, 8), layer)], [[0]], par)
    chunk = kv.group_data_refs[0][0].mapping.canonical_page_size_bytes
    config = OffloadingConfig.from_dict({"groups": [16], "extra_config": {
        "num_cpu_chunks": 6, "kv_bytes_per_chunk": chunk, "namespace": {"model": "m"},
        "secondary_tiers": [{"type": "storage", "path": str(tmp_path / "kv"), "capacity_bytes": "256KiB"}]}})
    return TieredOffloadingSpec(config), kv


@pytest.mark.parametrize("manager_first", [True, False])
def test_first_start_makes_one_namespace_directory(tmp_path, manager_first):
    """The spec checks its tiers at construction, then keeps nothing: the
    namespace is known once the KV caches are. Opened before them (the
    manager first), the assumed namespace's directory is removed when the
    tier reopens under the real one: one directory, one capacity of slabs."""
    import json
    import os

    spec, kv = _canonical_spec(tmp_path)
    assert _ns_dirs(tmp_path / "kv") == {}  # checked, released: nothing on disk yet
    if manager_first:
        spec.get_manager()
        (opened,) = _ns_dirs(tmp_path / "kv").values()
        assert not [f for f in opened if f.startswith("slab-")]  # no disk space taken before the layout is known
    worker = spec.get_worker(kv)
    mgr = spec.get_manager()
    dirs = _ns_dirs(tmp_path / "kv")
    assert len(dirs) == 1, dirs
    (name, files), = dirs.items()
    assert json.loads((tmp_path / "kv" / name / "namespace.json").read_text())["parallel_layout"] == "agnostic"
    slabs = [f for f in files if f.startswith("slab-")]
    assert sum(os.path.getsize(tmp_path / "kv" / name / f) for f in slabs) == 256 << 10
    mgr.shutdown()
    worker.shutdown()


def test_a_start_failing_after_the_tiers_were_built_removes_what_they_created(tmp_path):
    from kvoffload.kv_caches import random_kv_caches

    spec = _spec(tmp_path)
    spec.get_manager()  # the tiers are open (a directory made)
    assert len(_ns_dirs(tmp_path / "kv")) == 1
    _, wrong = random_kv_caches(8, [4096])  # pages of another size than the configured chunk
    with pytest.raises(Exception):
        spec.get_worker(wrong)
    assert not (tmp_path / "kv").exists()  # the directory this start made is gone


EXITS = """
import sys
sys.path.insert(0, {here!r})
from kvoffload.abstractions import GPULoadStoreSpec, ReqContext
from kvoffload.kv_caches import random_kv_caches
from test_tiering_spec import _spec
from tiering_rig import END, key
import pathlib
spec = _spec(pathlib.Path(sys.argv[1]))
tensors, caches = random_kv_caches(8, [8192, 8192])
mgr, worker = spec.get_manager(), spec.get_worker(caches)  # slab files made
if sys.argv[2] == "store":
    ctx = ReqContext("r")
    mgr.on_new_request(ctx)
    out = mgr.prepare_store([key(1)], ctx)
    assert worker.submit_store(1, GPULoadStoreSpec([0]), out.store_spec)
    worker.wait({{1}})
    mgr.complete_store(out.keys_to_store, ctx)
    for _ in range(200):
        mgr.on_schedule_end(END)
        mgr.wait_idle()
        if mgr.get_stats().children[1].counters.get("stored_blocks"):
            break
raise RuntimeError("the engine failed after the tiers were built")
"""


@pytest.mark.parametrize("then", ["nothing", "store"])
def test_a_process_failing_after_start_leaves_no_unused_slabs(tmp_path, then):
    """An engine that fails later (an exception out of its start, its
    process exiting) leaves no slab file it never stored to; one that stored
    keeps its directory, and the block stored is committed at exit."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", EXITS.format(here=str(HERE)), str(tmp_path), then],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 1 and "the engine failed" in out.stderr, out.stderr
    if then == "nothing":
        assert not (tmp_path / "kv").exists(), _ns_dirs(tmp_path / "kv")
        return
    spec = _spec(tmp_path)
    mgr = spec.get_manager()
    ctx = ReqContext("s")
    mgr.on_new_request(ctx)
    assert mgr.lookup(key(1), ctx) is not None and len(_ns_dirs(tmp_path / "kv")) == 1
    assert mgr.tiers[0].backend.get_manager().lookup(key(1), ctx).name == "HIT"
    mgr.shutdown()
