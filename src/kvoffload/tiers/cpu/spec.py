"""CPUOffloadingSpec: the CPU tier (host DRAM) built from one OffloadingConfig.

extra_config keys:
  cpu_bytes_to_use     host pool size ("8GiB" or bytes); the number of chunk
                       slots is this divided by the 4 KiB-aligned chunk size
  num_cpu_chunks       the number of chunk slots directly (instead of bytes)
  kv_bytes_per_chunk   bytes of one offloaded chunk (all layers of the
  kv_bytes_per_token   largest KV group), or per token of it
  eviction_policy      "hubchain" (default), "lru", "arc" or "module:Class"
  block_size           tokens per offloaded chunk (instead of blocks_per_chunk)
  offload_prompt_only, self_describing_kv_events   see OffloadingSpec
  shared_pool_path     a file (e.g. on /dev/shm) holding one host pool for all
                       TP ranks of a node, which may be processes: TP rank 0's
                       worker creates it, the others open it (waiting for it),
                       each stores its part of the canonical pages
  tp_rank, tp_size     where this worker sits in tensor parallelism
  store_threshold      (this spec only, as vLLM's CPU spec) store a chunk only
                       on its Nth offer (int, default 1: every offer);
                       max_tracker_size: keys whose offers are counted (64000)

The manager lives in the scheduler and is built before any KV cache exists,
so with cpu_bytes_to_use it needs the chunk size up front: give
kv_bytes_per_chunk / kv_bytes_per_token, or num_cpu_chunks instead. The
worker then checks the declared size against the real KV caches and raises
ConfigError on a mismatch (the pool would not hold what the manager counts).
Without any of them, get_worker() must come first (one process): the size
is then taken from the KV caches, or, with shared_pool_path, from the pool
file the workers made (a manager in another process reads its header).
The result is one ChunkGeometry (kvoffload.geometry), resolved once into
a ResolvedGeometry the manager shares (it may be built before the size is known).

A model with a KV group of a kind we cannot offload (config groups[].kind
"mamba", "ssm", "indexer", ...) is refused at construction with
UnsupportedModelError naming its layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from kvoffload.abstractions import CanonicalKVCaches, OffloadingSpec
from kvoffload.config import (
    CacheConfig,
    ConfigError,
    OffloadingConfig,
    check_fits_in_memory,
    check_known_keys,
    parse_bytes,
    positive_int,
)
from kvoffload.geometry import (
    ChunkGeometry,
    ResolvedGeometry,
    check_measured,
    check_pool_file,
    chunks_in,
    declared_chunk_bytes,
)
from kvoffload.layout import ParallelLayout, check_config_offloadable
from kvoffload.policies import DEFAULT_POLICY, get_policy_class
from kvoffload.tiers.cpu.store_threshold import DEFAULT_TRACKER_KEYS, StoreThresholdManager
from kvoffload.tiers.host_pool import slot_bytes

# How long a process waits for TP rank 0 to make the shared pool file
# (ranks start together, but a loaded node is slow).
POOL_WAIT_S = 300.0
# The manager's own memory per chunk slot (state list entry, policy entries), roughly.
MANAGER_BYTES_PER_CHUNK = 64


class CPUOffloadingSpec(OffloadingSpec):
    # Subclasses extend this with their own keys.
    EXTRA_KEYS: ClassVar[tuple[str, ...]] = (
        "cpu_bytes_to_use", "num_cpu_chunks", "kv_bytes_per_chunk", "kv_bytes_per_token",
        "eviction_policy", "block_size", "offload_prompt_only", "self_describing_kv_events",
        "shared_pool_path", "tp_rank", "tp_size",
        # read by the spec registry / vLLM's connector, not by us
        "spec_name", "spec_module_path",
    )
    # Keys of this spec itself, not of specs built around its CPU tier (the
    # tiered spec promotes into the CPU tier through the same prepare_store).
    OWN_KEYS: ClassVar[tuple[str, ...]] = ("store_threshold", "max_tracker_size")

    def __init__(self, config: OffloadingConfig):
        extra = config.extra_config
        check_known_keys(extra, self.EXTRA_KEYS + self.OWN_KEYS, f"{type(self).__name__} extra_config")
        config = self._apply_block_size(config, extra.get("block_size"))
        check_config_offloadable(config)  # Mamba/SSM or indexer state: refuse, never serve it wrong
        super().__init__(config)
        self.store_threshold = positive_int(extra.get("store_threshold", 1), "store_threshold")
        self.max_tracker_size = positive_int(extra.get("max_tracker_size", DEFAULT_TRACKER_KEYS), "max_tracker_size")
        self.eviction_policy: str = extra.get("eviction_policy", DEFAULT_POLICY)
        get_policy_class(self.eviction_policy)  # unknown policy: ConfigError now, not at get_manager
        declared_bytes = declared_chunk_bytes(extra, self.config.tokens_per_chunk)
        if "num_cpu_chunks" in extra and "cpu_bytes_to_use" in extra:
            raise ConfigError("give cpu_bytes_to_use or num_cpu_chunks, not both")
        if "num_cpu_chunks" in extra:
            self.cpu_bytes_to_use = None
            self._declared_chunks: int | None = positive_int(extra["num_cpu_chunks"], "num_cpu_chunks")
        elif "cpu_bytes_to_use" in extra:
            self.cpu_bytes_to_use = parse_bytes(extra["cpu_bytes_to_use"], "cpu_bytes_to_use")
            self._declared_chunks = None
        else:
            raise ConfigError("CPU offloading needs extra_config cpu_bytes_to_use (or num_cpu_chunks)")
        # None until a source knows both the chunk size and the count (geometry.py)
        self._resolved = ResolvedGeometry()  # shared with the manager
        if declared_bytes is not None:  # with either count key: resolved now
            self._resolve(declared_bytes, self._declared_chunks)
        tp_size = positive_int(extra.get("tp_size", 1), "tp_size")
        tp_rank = extra.get("tp_rank", 0)
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
            raise ConfigError(f"tp_rank must be an integer in [0, tp_size={tp_size}), got {tp_rank!r}")
        self.parallel = ParallelLayout(tp_rank, tp_size)
        path = extra.get("shared_pool_path")
        if path is not None and (not isinstance(path, str) or not path):
            raise ConfigError(f"shared_pool_path must be a file path, got {path!r}")
        self.shared_pool_path: str | None = path
        self.shared_pool = None  # the SharedHostPool this process's worker uses, if any
        self.pool_trailer_bytes = 0  # room after each pool chunk a secondary tier asks for (the tiered spec sets it)
        self._manager = None
        self._worker = None
        # A private pool is refused now if it cannot fit; a shared one when its file is made
        # (another process may already hold it: its memory is no longer "available").
        self._check_memory(self.kv_bytes_per_chunk if path is None else None, pool=path is None)

    @property
    def geometry(self) -> ChunkGeometry | None:
        return self._resolved.geometry

    @property
    def num_chunks(self) -> int | None:
        """Chunk slots in the CPU tier, once known (num_cpu_chunks, or the geometry)."""
        return self.geometry.num_chunks if self.geometry is not None else self._declared_chunks

    @property
    def kv_bytes_per_chunk(self) -> int | None:
        """KV bytes of one chunk, once known."""
        return self.geometry.chunk_bytes if self.geometry is not None else None

    def _resolve(self, chunk_bytes: int, num_chunks: int | None) -> None:
        """The geometry, once: the count is cpu_bytes_to_use's slots unless given."""
        if num_chunks is None:
            num_chunks = chunks_in(self.cpu_bytes_to_use, chunk_bytes)
        self._resolved.geometry = ChunkGeometry(self.config.tokens_per_chunk, chunk_bytes, num_chunks)

    @property
    def worker(self):
        """The worker get_worker() made in this process, or None."""
        return self._worker

    def _check_memory(self, chunk_bytes: int | None, pool: bool) -> None:
        """ConfigError, before anything is allocated, when the host pool (if
        `pool`) and the manager's slots need more memory than is available."""
        if self.num_chunks is None:
            if pool and self.cpu_bytes_to_use is not None:
                check_fits_in_memory(self.cpu_bytes_to_use, f"cpu_bytes_to_use={self.cpu_bytes_to_use}")
            return
        slot = slot_bytes(chunk_bytes, self.pool_trailer_bytes) if pool and chunk_bytes else 0
        what = f"a CPU tier of {self.num_chunks} chunks" + (f" of {slot} bytes" if slot else "")
        check_fits_in_memory(self.num_chunks * (slot + MANAGER_BYTES_PER_CHUNK), what)

    @staticmethod
    def _apply_block_size(config: OffloadingConfig, block_size: Any) -> OffloadingConfig:
        """block_size (tokens per chunk) is another way to say blocks_per_chunk."""
        if block_size is None:
            return config
        block_size = positive_int(block_size, "block_size")
        tph = config.cache.tokens_per_hash
        if block_size % tph:
            raise ConfigError(f"block_size={block_size} must be a multiple of tokens_per_hash={tph}")
        bpc = block_size // tph
        if config.cache.blocks_per_chunk not in (1, bpc):
            raise ConfigError(
                f"block_size={block_size} means blocks_per_chunk={bpc}, "
                f"but blocks_per_chunk={config.cache.blocks_per_chunk} was given"
            )
        return dataclasses.replace(config, cache=CacheConfig(tph, bpc))  # re-validated

    def get_manager(self):
        if self._manager is None:
            from kvoffload.tiers.cpu.manager import CPUOffloadingManager

            if self.num_chunks is None and self.shared_pool_path is not None:
                self.take_pool_geometry()
            if self.num_chunks is None:
                raise ConfigError(
                    "cpu_bytes_to_use alone does not say how many chunks fit before the KV caches "
                    "exist: add extra_config kv_bytes_per_chunk or kv_bytes_per_token, or give "
                    "num_cpu_chunks (or call get_worker first, in the same process)"
                )
            self._check_memory(None, pool=False)  # the manager's slots (a pool's geometry may be new)
            self._manager = CPUOffloadingManager(
                self.num_chunks, policy=self.eviction_policy,
                enable_events=self.kv_events_config.enable_kv_cache_events, geometry=self._resolved,
            )
            if self.store_threshold > 1:
                self._manager = StoreThresholdManager(self._manager, self.store_threshold, self.max_tracker_size)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches):
        from kvoffload.tiers.cpu.worker import CPUOffloadingWorker, chunk_layout

        _, chunk_bytes = chunk_layout(kv_caches, self.config)
        check_measured(self.kv_bytes_per_chunk, chunk_bytes, self.config.tokens_per_chunk)
        if self.geometry is None:
            self._resolve(chunk_bytes, self.num_chunks)
        # Only the process that makes a shared pool's file allocates it.
        self._check_memory(chunk_bytes, pool=self.shared_pool_path is None or self.parallel.tp_rank == 0)
        pool = self._shared_pool(kv_caches, chunk_bytes) if self.shared_pool_path is not None else None
        try:
            self._worker = CPUOffloadingWorker(kv_caches, self.config, self.num_chunks, pool=pool,
                                               trailer_bytes=self.pool_trailer_bytes)
        except BaseException:
            if pool is not None:
                pool.close()
            raise
        self.shared_pool = pool
        return self._worker

    def _shared_pool(self, kv_caches: CanonicalKVCaches, chunk_bytes: int):
        """TP rank 0 makes the pool file, the other ranks open it."""
        from kvoffload.layout import check_shareable
        from kvoffload.tiers.host_pool import SharedHostPool

        try:
            check_shareable(kv_caches)
        except ValueError as e:
            raise ConfigError(f"shared_pool_path={self.shared_pool_path!r} needs canonical pages "
                              f"(all KV heads of a block in one page): {e}") from None
        if self.parallel.tp_rank == 0:
            return SharedHostPool.create(self.shared_pool_path, self.num_chunks, chunk_bytes, self.pool_trailer_bytes)
        return SharedHostPool.open(self.shared_pool_path, self.num_chunks, chunk_bytes, wait_s=POOL_WAIT_S,
                                   trailer_bytes=self.pool_trailer_bytes)

    def take_pool_geometry(self) -> None:
        """Chunk count and size from the pool file the workers made (for a
        manager in another process), checked against what was declared."""
        from kvoffload.tiers.host_pool import SharedHostPool

        num_chunks, chunk_bytes = SharedHostPool.geometry(self.shared_pool_path, POOL_WAIT_S)
        check_pool_file(self.shared_pool_path, num_chunks, chunk_bytes, self.num_chunks, self.kv_bytes_per_chunk)
        if self.geometry is None:
            self._resolve(chunk_bytes, num_chunks)
