"""TieredOffloadingSpec: the "tiered" spec, a CPU spec plus secondary tiers.

extra_config (besides the CPU spec's keys, kvoffload.tiers.cpu.spec):
  secondary_tiers: [{"type": "storage", "path": "/nvme/kv", "capacity_bytes": "64GiB",
                     "eviction_policy": "lru", "admission": "tinylfu", "store_threshold": 2,
                     "max_queue_depth": 256}, ...]
    admission        a filter of tiering/admission.py ("store_count", "tinylfu"
                     or "module:Class") deciding which chunks are written to
                     the tier; store_threshold is its threshold. Without it,
                     store_threshold > 1 means "store_count"; by default
                     every chunk stored in CPU is written down.
  namespace: {"model": ..., "dtype": ..., "layout": ..., "parallel_layout": ...}
    what must match for persisted chunks to be served (tokens per chunk and
    chunk bytes are added from the config; parallel_layout from the KV
    caches: "agnostic" for canonical pages, else one per TP rank)
  tp_rank, tp_size             (CPU spec keys) also pick the namespace's parallel_layout
  storage_dir, storage_bytes   shorthand for one more storage tier
  remote_url                   shorthand for one more remote tier ("mooncake" for a
                               mooncake://HOST:PORT url, else "redis")
  promotion_deadline_s         how long a request waits for a promotion in flight
                               before it computes instead (2.0; 0 or null: no limit)

The tiers are checked (directories opened, indexes read, servers reached)
at construction when kv_bytes_per_chunk / kv_bytes_per_token is given, so
config errors and unusable directories surface then, and released at once:
the namespace (parallel_layout) is known only once the KV caches are, and a
start refused before them must leave nothing behind. They are opened for
use by get_manager() / get_worker(); a storage tier takes its disk space
(slab files) only when its worker is made. Opened before the KV caches
exist (get_manager() first), they assume opaque per-rank pages, and
get_worker() reopens them if the pages turn out canonical: the first
namespace's directory, unused, is removed. A get_worker() that fails
releases the tiers and removes what they created.

The secondary workers read and write host-pool chunks, and the pool is made
by the CPU worker, so they are attached (attach_tier_workers) where the pool
is: in get_worker() when the scheduler-side manager and the worker share a
process (vLLM's UniProcExecutor, `kvoffload replay`), or beside the manager
on the ranks' shared host pool under tensor parallelism (integrations/vllm).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from kvoffload.abstractions import CanonicalKVCaches, OffloadingSpec, OffloadingWorker
from kvoffload.config import ConfigError, OffloadingConfig, check_known_keys, positive_int
from kvoffload.layout import parallel_layout_id
from kvoffload.tiering.admission import make_admission
from kvoffload.redact import redact
from kvoffload.tiering.manager import TieringManager
from kvoffload.tiering.tier import (
    DEFAULT_MAX_QUEUE_DEPTH,
    DEFAULT_STORE_THRESHOLD,
    TIER_KEYS,
    Tier,
    TierContext,
    get_tier_class,
    tier_type_names,
)
from kvoffload.align import align_up
from kvoffload.tiers.base import Namespace
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.cpu.spec import CPUOffloadingSpec


# A request waits at most this long for a promotion in flight before its
# lookups answer MISS and it computes instead (a slow or stuck tier, e.g. a
# Mooncake node whose transfers queue behind one that stopped answering).
DEFAULT_PROMOTION_DEADLINE_S = 2.0


class TieredOffloadingSpec(OffloadingSpec):
    EXTRA_KEYS = CPUOffloadingSpec.EXTRA_KEYS + (
        "secondary_tiers", "namespace", "storage_dir", "storage_bytes", "remote_url", "promotion_deadline_s")

    def __init__(self, config: OffloadingConfig):
        extra = config.extra_config
        check_known_keys(extra, self.EXTRA_KEYS, f"{type(self).__name__} extra_config")
        self.cpu = CPUOffloadingSpec(dataclasses.replace(config, extra_config={
            k: v for k, v in extra.items() if k in CPUOffloadingSpec.EXTRA_KEYS}))
        # the CPU spec's config (block_size applied) with all of our extra_config
        super().__init__(dataclasses.replace(self.cpu.config, extra_config=extra))
        self.tier_configs: list[dict[str, Any]] = _tier_configs(extra)
        self.promotion_deadline_s = _deadline(extra.get("promotion_deadline_s", DEFAULT_PROMOTION_DEADLINE_S))
        # room after each host-pool chunk a tier keeps its value header in (Mooncake: one buffer per key)
        self.cpu.pool_trailer_bytes = max((getattr(get_tier_class(c["type"]), "POOL_TRAILER_BYTES", 0)
                                           for c in self.tier_configs), default=0)
        ns = extra.get("namespace") or {}
        if not isinstance(ns, dict):
            raise ConfigError(f"namespace must be a mapping, got {ns!r}")
        check_known_keys(ns, ("model", "dtype", "layout", "parallel_layout"), "namespace")
        self.namespace_fields = {k: str(v) for k, v in ns.items()}
        # until the KV caches say otherwise: pages only this rank's layout may read
        self.parallel_layout = f"tp{self.parallel.tp_size}-rank{self.parallel.tp_rank}"
        self._tiering: TieringManager | None = None
        self._tiers: list[Tier] | None = None
        if self.kv_bytes_per_chunk is not None:
            self._build_tiers()  # config errors and unusable directories surface now
            self._release_tiers()  # nothing kept before the namespace is known

    # ---- the CPU spec's, read through --------------------------------------

    @property
    def parallel(self):
        return self.cpu.parallel

    @property
    def geometry(self):
        return self.cpu.geometry

    @property
    def num_chunks(self) -> int | None:
        return self.cpu.num_chunks

    @property
    def kv_bytes_per_chunk(self) -> int | None:
        return self.cpu.kv_bytes_per_chunk

    @property
    def shared_pool_path(self) -> str | None:
        return self.cpu.shared_pool_path

    @property
    def shared_pool(self):
        return self.cpu.shared_pool

    @property
    def worker(self) -> OffloadingWorker | None:
        return self.cpu.worker

    def take_pool_geometry(self) -> None:
        self.cpu.take_pool_geometry()

    # ---- tiers ---------------------------------------------------------------

    def namespace(self) -> Namespace:
        groups = ",".join(f"{g.tokens_per_block}/{g.sliding_window or 0}" for g in self.config.groups)
        fields = {"layout": f"groups={groups};tph={self.config.cache.tokens_per_hash}",
                  "parallel_layout": self.parallel_layout, **self.namespace_fields}
        return Namespace(block_size=self.config.tokens_per_chunk,
                         chunk_bytes=align_up(self.kv_bytes_per_chunk), **fields)

    def _build_tiers(self) -> list[Tier]:
        if self._tiers is not None:
            return self._tiers
        tiers, names, paths = [], set(), {}
        try:
            for i, conf in enumerate(self.tier_configs):
                tiers.append(self._build_tier(i, conf, names, paths))
        except BaseException:
            _release(tiers)  # what was opened (fds, directory locks, files made) so a retry can succeed
            raise
        self._tiers = tiers
        return tiers

    def _release_tiers(self) -> None:
        """Close the tiers; the ones that stored nothing also remove what they created."""
        if self._tiers is not None:
            tiers, self._tiers = self._tiers, None
            _release(tiers)

    def _build_tier(self, i: int, conf: dict[str, Any], names: set[str], paths: dict[str, int]) -> Tier:
        where = f"secondary_tiers[{i}]"
        cls = get_tier_class(conf["type"])
        name = str(conf.get("name", conf["type"] if conf["type"] not in names else f"{conf['type']}{i}"))
        if name in names:
            raise ConfigError(f"{where}: name {name!r} is used twice")
        names.add(name)
        if isinstance(conf.get("path"), str):  # two tiers on one directory would fight over it
            if "\0" in conf["path"]:  # realpath would raise a bare ValueError
                raise ConfigError(f"{where}.path: contains a NUL byte: {conf['path']!r}")
            real = os.path.realpath(conf["path"])
            if real in paths:
                raise ConfigError(f"{where}.path: {conf['path']!r} is listed twice in secondary_tiers "
                                  f"(also secondary_tiers[{paths[real]}]); give each tier its own")
            paths[real] = i
        threshold = positive_int(conf.get("store_threshold", DEFAULT_STORE_THRESHOLD), f"{where}.store_threshold")
        depth = positive_int(conf.get("max_queue_depth", DEFAULT_MAX_QUEUE_DEPTH), f"{where}.max_queue_depth")
        admission = None
        if "admission" in conf:
            admission = make_admission(conf["admission"], threshold if "store_threshold" in conf else None,
                                       f"{where}.admission")
        ctx = TierContext(i, name, self.namespace(), align_up(self.kv_bytes_per_chunk),
                          self.kv_events_config.enable_kv_cache_events)
        backend = cls.from_config({k: v for k, v in conf.items() if k not in TIER_KEYS}, ctx)
        return Tier(backend, threshold, depth, admission)

    def get_manager(self) -> TieringManager:
        if self._tiering is None:
            primary = self.cpu.get_manager()  # raises if the chunk size is not known yet
            self._tiering = TieringManager(primary, self._build_tiers(),
                                           promotion_deadline_s=self.promotion_deadline_s)
        return self._tiering

    def attach_tier_workers(self, pool: HostPool) -> None:
        """Give each secondary tier its worker, on the host pool it copies from and into."""
        manager = self.get_manager()
        manager.attach_workers([t.backend.get_worker(pool) for t in manager.tiers])

    def _set_parallel_layout(self, kv_caches: CanonicalKVCaches) -> None:
        """Namespace.parallel_layout from the pages this rank's pool will hold,
        so persisted opaque pages are never served to another TP layout."""
        actual = parallel_layout_id(kv_caches, self.parallel)
        given = self.namespace_fields.get("parallel_layout")
        if given is not None and given != actual:
            raise ConfigError(f"namespace.parallel_layout={given!r}, but this rank's pages are {actual!r}: "
                              "another layout would read wrong bytes; leave it out (it is derived)")
        if actual == self.parallel_layout:
            return
        self.parallel_layout = actual
        if self._tiers is not None and given is None:  # opened under the assumed layout: reopen
            self._release_tiers()  # unused (no worker yet): the assumed namespace's files go
            tiers = self._build_tiers()
            if self._tiering is not None:  # no worker attached yet, so its tiers were never used
                self._tiering.replace_tiers(tiers)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        try:
            self._set_parallel_layout(kv_caches)
            worker = self.cpu.get_worker(kv_caches)
            self.attach_tier_workers(worker.pool)  # same process: the tiers need the CPU worker's pool
        except BaseException:  # a failed start removes what it created (slab files included)
            self._release_tiers()
            raise
        return worker


def _release(tiers: list[Tier]) -> None:
    for t in tiers:
        discard = getattr(t.backend, "discard", None)
        if discard is not None:
            discard()
        else:
            t.manager.shutdown()


def _deadline(value: Any) -> float | None:
    """promotion_deadline_s: seconds (> 0), or 0 / null for no deadline."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ConfigError(f"promotion_deadline_s must be seconds (a number >= 0; 0 or null: none), got {value!r}")
    return float(value) or None


def _tier_configs(extra: dict[str, Any]) -> list[dict[str, Any]]:
    """secondary_tiers plus the shorthands' tiers, each checked for a known type."""
    confs = extra.get("secondary_tiers") or []
    if not isinstance(confs, list):
        raise ConfigError(f"secondary_tiers must be a list, got {redact(confs)!r}")
    confs = list(confs)
    if "storage_dir" in extra or "storage_bytes" in extra:
        if not extra.get("storage_dir") or "storage_bytes" not in extra:
            raise ConfigError("storage_dir and storage_bytes go together (a directory and its capacity)")
        confs.append({"type": "storage", "path": extra["storage_dir"], "capacity_bytes": extra["storage_bytes"]})
    if extra.get("remote_url"):  # the scheme picks the tier type: mooncake://, else Redis
        url = extra["remote_url"]
        kind = "mooncake" if isinstance(url, str) and url.startswith("mooncake://") else "redis"
        confs.append({"type": kind, "url": url})
    for i, conf in enumerate(confs):
        if not isinstance(conf, dict):
            raise ConfigError(f"secondary_tiers[{i}] must be a mapping, got {redact(conf)!r}")
        if "type" not in conf:
            raise ConfigError(f"secondary_tiers[{i}]: type is required; known types: {tier_type_names()}")
        get_tier_class(conf["type"])  # unknown type: error now
    return confs
