"""vLLM's real offloading config and KV cache types as the adapter's tests
build them: a config for one engine (or TP rank), per-layer int8 caches with
distinct bytes, offload keys and request contexts. Imported after the test
module's vLLM guard."""

from __future__ import annotations

import torch
from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload import config as vconf

BLOCK = 32
PAGE = 4096  # bytes per GPU block per layer
LAYERS = 2
NUM_GPU_BLOCKS = 16


def vllm_config(extra: dict, world_size: int = 1, bytes_per_block: int = PAGE * LAYERS,
                events: bool = False, engine_id: str = "test-engine", rank: int = 0,
                pp_size: int = 1) -> vconf.OffloadingConfig:
    """A real vLLM OffloadingConfig (fields common to 0.32 and 0.33)."""
    return vconf.OffloadingConfig(
        groups=(vconf.OffloadingGroupConfig(tokens_per_block=BLOCK, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=bytes_per_block,
        enable_kv_cache_events=events,
        extra_config={"spec_name": "KVOffloadingSpec", "spec_module_path": "kvoffload.integrations.vllm",
                      **extra},
        engine_id=engine_id,
        model=vconf.OffloadingModelConfig(name="tiny", dtype="bfloat16"),
        cache=vconf.OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=1),
        parallel=vconf.OffloadingParallelConfig(
            rank=rank, world_size=world_size, tp_size=world_size // pp_size, pp_size=pp_size,
            pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True),
    )


def vllm_kv_caches() -> tuple[list[torch.Tensor], vbase.CanonicalKVCaches]:
    """Per-layer int8 (num_blocks, page) tensors with distinct random bytes,
    as vLLM's worker hands them to a spec."""
    g = torch.Generator().manual_seed(0)
    layers = [torch.randint(-128, 128, (NUM_GPU_BLOCKS, PAGE), dtype=torch.int8, generator=g)
              for _ in range(LAYERS)]
    caches = vbase.CanonicalKVCaches(
        tensors=[vbase.CanonicalKVCacheTensor(t, PAGE) for t in layers],
        group_data_refs=[[vbase.CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]],
    )
    return layers, caches


def key(i: int) -> bytes:
    return vbase.make_offload_key(i.to_bytes(8, "big"), 0)


def ctx(req_id: str = "r") -> vbase.ReqContext:
    return vbase.ReqContext(req_id=req_id)


HALF = PAGE // 2  # one KV head's K (or V) bytes in a block


def tp2_kv_caches(full: list[torch.Tensor], rank: int) -> tuple[list[torch.Tensor], vbase.CanonicalKVCaches]:
    """What TP rank `rank` of 2 holds of TP=1 layers whose page is [K head 0,
    K head 1, V head 0, V head 1] (HALF bytes each): its head's K and V,
    with vLLM's mapping of them into the canonical (TP=1) page."""
    run = vbase.CopyRun(local_offset=0, canonical_offset=rank * HALF, fragment_size=HALF, num_fragments=2,
                        local_stride=HALF, canonical_stride=2 * HALF)
    mapping = vbase.CanonicalPageMapping(canonical_page_size_bytes=2 * PAGE, local_page_size_bytes=PAGE,
                                         runs=(run,), num_writers=1, writer_index=0, parallelism_agnostic=True)
    local = [torch.cat([t[:, rank * HALF:(rank + 1) * HALF], t[:, PAGE + rank * HALF:PAGE + (rank + 1) * HALF]],
                       dim=1).contiguous() for t in full]
    return local, vbase.CanonicalKVCaches(
        tensors=[vbase.CanonicalKVCacheTensor(t, PAGE) for t in local],
        group_data_refs=[[vbase.CanonicalKVCacheRef(i, PAGE, mapping) for i in range(LAYERS)]])
