"""Builds kvoffload's SGLang backend as SGLang's HiCacheController does
(StorageBackendFactory, then the host pool registered), with the tier
sections, keys and page helpers the backend's tests share."""

from __future__ import annotations

import torch

from sglang_pool import SGLangMHAHostPool, need_sglang

need_sglang()
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

PAGE = 16
PATIENT = dict(lookup_deadline_s=30.0, connect_timeout_s=10.0)  # a loaded machine must not turn a HIT into a MISS


def storage_config(extra: dict, tp_rank=0, tp_size=1, model="tiny-llama") -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                                is_page_first_layout=True, model_name=model, extra_config=extra)


def tier_section(kind: str, request, tmp_path, prefix: str) -> dict:
    if kind == "storage":
        return {"type": "storage", "path": str(tmp_path / "l3"), "capacity_bytes": "4MiB", "direct_io": False}
    if kind == "redis":
        srv = request.getfixturevalue("redis_server")
        return {"type": "redis", "url": srv.url, "key_prefix": prefix, **PATIENT}
    srv = request.getfixturevalue("mooncake")
    return {"type": "mooncake", **srv.tier_config(key_prefix=prefix, segment_bytes=0, rpc_timeout_s=30.0, **PATIENT)}


def make_backend(section: dict, layout="page_first", staging="1MiB", job="8KiB", **cfg) -> tuple[HiCacheStorage, SGLangMHAHostPool]:
    """What SGLang's HiCacheController does: factory, then register the host pool."""
    extra = {"backend_name": "kvoffload", "module_path": "kvoffload.integrations.sglang",
             "class_name": "KvoffloadHiCacheStorage", "interface_v1": 1,
             "kvoffload": {"staging_bytes": staging, "job_bytes": job, **section}}
    pool = SGLangMHAHostPool(size=16 * PAGE, page_size=PAGE, layer_num=2, head_num=2, head_dim=32, layout=layout)
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **cfg), pool)
    backend.register_mem_pool_host(pool)
    return backend, pool


def keys(n: int, salt: str = "") -> list[str]:
    import hashlib

    return [hashlib.sha256(f"{salt}page{i}".encode()).hexdigest() for i in range(n)]


def pages(*ids: int) -> torch.Tensor:
    """host indices of whole pages"""
    return torch.cat([torch.arange(i * PAGE, (i + 1) * PAGE) for i in ids])


def page_bytes(pool, page_id: int) -> bytes:
    return pool.get_data_page(page_id * PAGE, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def make_mla_backend(section: dict, layout="page_first", tp_rank=0, tp_size=1):
    from sglang_pool import SGLangMLAHostPool

    extra = {"backend_name": "kvoffload", "module_path": "kvoffload.integrations.sglang.backend",
             "class_name": "KvoffloadHiCacheStorage", "interface_v1": 1, "kvoffload": section}
    cfg = HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                               attn_cp_size=1, is_mla_model=True, enable_storage_metrics=False,
                               is_page_first_layout=True, model_name="tiny-mla", extra_config=extra)
    pool = SGLangMLAHostPool(size=8 * PAGE, page_size=PAGE, layer_num=3, layout=layout)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    return backend, pool


def storage_section(tmp_path) -> dict:
    return {"type": "storage", "path": str(tmp_path / "l3"), "capacity_bytes": "1MiB", "direct_io": False}


def settled(backend) -> bool:
    """No storage-tier block left pinned, no job result left uncollected."""
    return backend.io.manager.get_stats().gauges["pinned_blocks"] == 0 and not backend.io._results
