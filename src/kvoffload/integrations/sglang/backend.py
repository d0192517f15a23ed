"""kvoffload's storage, Redis and Mooncake tiers as an SGLang HiCache L3
storage backend (a `HiCacheStorage` loaded by module path).

SGLang builds it with `cls(storage_config, kwargs)` and then registers its
host KV pool; the tier is opened then, when the page size is known. With
`"interface_v1": 1` in the extra config SGLang calls the zero-copy batch
calls with host indices (batch_get_v1 / batch_set_v1); without it, the
generic ones with flat page tensors. Both store the same bytes (pages.py).

Pages go host pool -> staging slot (one memcpy) -> the tier's own worker,
so the tier's header, checksum, MAC, back-off and counters are the ones
vLLM's engines use. A page that fails its load (missing, corrupt, foreign,
forged, server down) is a miss: False for that key, never wrong bytes.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvoffload.config import ConfigError
from kvoffload.integrations.sglang.config import BackendConfig, parallel_layout
from kvoffload.integrations.sglang.pages import PageCopier, PageFormat, key_bytes
from kvoffload.integrations.sglang.tier_io import TierIO
from kvoffload.tiers.base import align_up
from kvoffload.tiers.host_pool import HostPool, slot_bytes

log = logging.getLogger(__name__)
MAX_STAGING_PAGES = 128  # SGLang's STORAGE_BATCH_SIZE: more slots than one call uses would idle


class KvoffloadHiCacheStorage(HiCacheStorage):
    default_tier: str | None = None  # the subclasses below fix it

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        self.config = BackendConfig.from_extra_config(storage_config.extra_config, self.default_tier)
        # host indices then count logical pages, or a page is stored as per-head slices: neither is mapped
        if getattr(storage_config, "dcp_size", 1) > 1:
            raise ConfigError("kvoffload SGLang backend: decode context parallelism (dcp_size > 1) is not supported")
        if getattr(storage_config, "should_split_heads", False):
            raise ConfigError("kvoffload SGLang backend: split-head pages (should_split_heads) are not supported")
        self.model = self.config.model or storage_config.model_name
        if not self.model:
            raise ConfigError("kvoffload SGLang backend: no model name for the namespace; "
                              "set extra_config.kvoffload.model")
        self.io: TierIO | None = None
        self.format: PageFormat | None = None
        self.namespace = None
        self._locks = (threading.Lock(), threading.Lock())  # load half, store half of the staging slots

    # -- set-up ---------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        if self.io is not None:
            raise RuntimeError("kvoffload SGLang backend: a host pool is already registered")
        super().register_mem_pool_host(mem_pool_host)
        fmt = PageFormat.of(mem_pool_host)
        trailer = self.config.pool_trailer_bytes
        half = max(1, min(MAX_STAGING_PAGES, self.config.staging_bytes // (2 * slot_bytes(fmt.page_bytes, trailer))))
        staging = HostPool(2 * half, fmt.page_bytes, trailer)
        namespace = fmt.namespace(self.model, parallel_layout(self.storage_config, self.config.tier_type))
        tier = self.config.build_tier(namespace, align_up(fmt.page_bytes))
        try:
            io = TierIO(tier, staging)
        except BaseException:  # e.g. a worker refused: close what the tier opened (a storage dir's lock)
            (getattr(tier, "shutdown", None) or tier.get_manager().shutdown)()
            staging.close()
            raise
        self.format, self.namespace, self._half = fmt, namespace, half
        self._part_pages = max(1, self.config.job_bytes // fmt.page_bytes)
        self._copier = PageCopier(mem_pool_host, fmt, staging)
        self.io = io
        log.info("kvoffload SGLang backend: %s tier, namespace %s (%s), %d-byte pages, %d staging slots",
                 self.config.tier_type, namespace.digest(), namespace.layout, fmt.page_bytes, 2 * half)

    def _slots(self, store: bool, n: int) -> list[int]:
        start = self._half if store else 0
        return list(range(start, start + n))

    def _rounds(self, n: int):
        """Page ranges that fit the staging slots of one direction."""
        for start in range(0, n, self._half):
            yield range(start, min(n, start + self._half))

    def _parts(self, rnd: range, store: bool):
        """A round split into jobs of about job_bytes, each with its own slots."""
        base = self._half if store else 0
        for start in range(rnd.start, rnd.stop, self._part_pages):
            part = range(start, min(rnd.stop, start + self._part_pages))
            first = base + part.start - rnd.start
            yield part, list(range(first, first + len(part)))

    def _check_indices(self, keys: List[str], host_indices: torch.Tensor) -> None:
        # before any job starts: a bad call must not leave jobs half done, and an index past the pool
        # would have the copy memmove to or from an address outside it (a crash, or corrupt memory)
        if not isinstance(host_indices, torch.Tensor):
            raise TypeError(f"host_indices must be a tensor, got {type(host_indices).__name__}")
        dt = host_indices.dtype
        if dt.is_floating_point or dt.is_complex or dt == torch.bool or host_indices.device.type != "cpu":
            raise TypeError(f"host_indices must be an integer CPU tensor, got {dt} on {host_indices.device}")
        ps = self.format.page_size
        if host_indices.numel() != len(keys) * ps:
            raise ValueError(f"{len(keys)} keys need {len(keys) * ps} host indices "
                             f"({ps} per page), got {host_indices.numel()}")
        if not len(keys):
            return
        starts = host_indices.reshape(-1)[::ps]  # the pool reads a page's place from its first index
        size = int(self.mem_pool_host.size)
        lo, hi = int(starts.min()), int(starts.max())
        if lo < 0 or hi + ps > size:
            raise ValueError(f"host_indices: pages start at {lo}..{hi}, outside the host pool's {size} tokens")

    # -- lookups --------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        if self.io is None or not keys:
            return 0
        return self.io.present_prefix([key_bytes(k) for k in keys])

    # -- zero-copy calls (interface_v1) ---------------------------------
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        results = [False] * len(keys)
        if self.io is None:
            return results
        self._check_indices(keys, host_indices)
        kb = [key_bytes(k) for k in keys]
        with self._locks[0]:
            for rnd in self._rounds(len(keys)):
                # every part in flight at once; copy each out as it lands, while later ones still load
                jobs = []
                try:
                    for part, slots in self._parts(rnd, store=False):
                        jobs.append((part, slots, self.io.start_load(kb[part.start : part.stop], slots)))
                    failed = []
                    while jobs:
                        part, slots, job = jobs.pop(0)
                        if self.io.finish(job):
                            self._copier.from_slots(host_indices, part, slots)
                            results[part.start : part.stop] = [True] * len(part)
                        else:
                            failed.append((part, slots))
                finally:  # on an error, every started job still ends: nothing stays pinned or uncollected
                    for _, _, job in jobs:
                        self.io.finish(job)
                # a failed job says not which key failed: ask again one by one
                for part, slots in failed:
                    for p, slot in zip(part, slots):
                        if self.io.load([kb[p]], [slot]):
                            self._copier.from_slots(host_indices, range(p, p + 1), [slot])
                            results[p] = True
        return results

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        if self.io is None:
            return [False] * len(keys)
        if not self.storage_config.is_storage_writer:
            return [True] * len(keys)  # an MLA replica: the writer rank stores the same bytes
        self._check_indices(keys, host_indices)
        kb = [key_bytes(k) for k in keys]
        results = [False] * len(keys)
        with self._locks[1]:
            for rnd in self._rounds(len(keys)):
                jobs = []
                try:
                    for part, slots in self._parts(rnd, store=True):  # copy a part while earlier ones store
                        self._copier.to_slots(host_indices, part, slots)
                        jobs.append((part, self.io.start_store(kb[part.start : part.stop], slots)))
                finally:  # on an error too: a started store left unfinished would answer HIT_PENDING for good
                    for part, job in jobs:
                        results[part.start : part.stop] = [self.io.finish(job)] * len(part)
        return results

    # -- generic calls: flat page tensors (get_data_page / dummy pages) --
    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        out: list[torch.Tensor | None] = [None] * len(keys)
        if self.io is None:
            return out
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        with self._locks[0]:
            for p, key in enumerate(keys):  # one by one: a miss must not fail its neighbours
                slot = self._slots(False, 1)[0]
                if self.io.load([key_bytes(key)], [slot]):
                    target = targets[p] if targets[p] is not None else self.mem_pool_host.get_dummy_flat_data_page()
                    out[p] = self._copier.slot_to_tensor(slot, target)
        return out

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        if self.io is None or values is None:
            return False
        if not self.storage_config.is_storage_writer:
            return True
        values = list(values)
        ok = True
        with self._locks[1]:
            for pages in self._rounds(len(keys)):
                slots = self._slots(True, len(pages))
                for p, slot in zip(pages, slots):
                    self._copier.tensor_to_slot(values[p], slot)
                ok = self.io.store([key_bytes(keys[p]) for p in pages], slots) and ok
        return ok

    # -- housekeeping ---------------------------------------------------
    def clear(self) -> None:
        """Forget what this process cached about the tier (the storage tier:
        drop its unpinned blocks). A shared server's data is other engines'
        too and is left alone."""
        if self.io is not None:
            self.io.reset()

    def get_stats(self):
        return None  # SGLang's StorageMetrics are not filled; kvoffload's own counters are in the tier

    def close(self) -> None:
        if self.io is not None:
            io, self.io = self.io, None
            io.close()
            self._copier.staging.close()


class KvoffloadStorageHiCache(KvoffloadHiCacheStorage):
    """The storage tier (slab files on a local disk): extra_config.kvoffload = {path, capacity_bytes, ...}."""

    default_tier = "storage"


class KvoffloadRedisHiCache(KvoffloadHiCacheStorage):
    """The Redis/Valkey tier: extra_config.kvoffload = {url, ...}."""

    default_tier = "redis"


class KvoffloadMooncakeHiCache(KvoffloadHiCacheStorage):
    """The Mooncake Store tier: extra_config.kvoffload = {master_address, metadata_server, ...}."""

    default_tier = "mooncake"
