"""The storage tier as a SecondaryTier: opens the directory (clear errors at
start-up), then hands out its manager and, once the host pool exists, its
worker."""

from __future__ import annotations

import os
from typing import Any

from kvoffload.abstractions import Locality, Medium
from kvoffload.config import ConfigError, check_known_keys, parse_bytes, positive_int, thread_count
from kvoffload.policies import get_policy_class
from kvoffload.tiers.base import Namespace, SecondaryTier
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.storage.manager import StorageOffloadingManager
from kvoffload.tiers.storage.store import SlabStore
from kvoffload.tiers.storage.worker import StorageWorker

CONFIG_KEYS = ("path", "capacity_bytes", "eviction_policy", "num_files", "io_threads", "direct_io",
               "commit_interval_ms", "commit_records")
DEFAULT_COMMIT_INTERVAL_MS = 100  # the group commit's period: what a crash can cost, in time
DEFAULT_COMMIT_RECORDS = 4096  # records waiting that start a commit before the period ends
# IO threads wait on the disk, not the CPU: a deep queue (bench_storage.py io, 256 KiB chunks on
# this VM's disk: fresh stores 2.3-2.6 GB/s at 16 threads against 1.2-2.2 at 4; loads alike)
DEFAULT_IO_THREADS = 16


class StorageTier(SecondaryTier):
    medium = Medium.STORAGE
    locality = Locality.LOCAL

    def __init__(self, path: str, capacity_bytes: int, slot_bytes: int, namespace: Namespace,
                 eviction_policy: str = "lru", num_files: int = 4, io_threads: int = DEFAULT_IO_THREADS,
                 direct_io: bool = True, enable_events: bool = False, name: str = "storage",
                 commit_interval_ms: float = DEFAULT_COMMIT_INTERVAL_MS,
                 commit_records: int = DEFAULT_COMMIT_RECORDS):
        self.name = name
        self.io_threads = io_threads
        self.store = SlabStore(path, namespace, slot_bytes, capacity_bytes // slot_bytes,
                               num_files=num_files, direct_io=direct_io,
                               commit_interval_s=commit_interval_ms / 1000, commit_records=commit_records)
        try:
            self._manager = StorageOffloadingManager(self.store, eviction_policy, enable_events, name)
        except BaseException:  # release the directory (lock, open-in-this-process mark) for a retry
            self.store.close()
            raise
        self._worker: StorageWorker | None = None

    @classmethod
    def from_config(cls, conf: dict[str, Any], ctx) -> StorageTier:
        """Build from one `secondary_tiers` entry (tier-level keys already removed)."""
        where = f"secondary_tiers[{ctx.index}] (storage)"
        check_known_keys(conf, CONFIG_KEYS, where)
        path = conf.get("path")
        if not path:
            raise ConfigError(f"{where}: path is required (a directory for the slab files)")
        # `path: 5` must not create ./5
        if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):
            raise ConfigError(f"{where}: path must be a directory name (a string), got {path!r}")
        if "\0" in os.fspath(path):
            raise ConfigError(f"{where}.path: contains a NUL byte: {path!r}")
        if "capacity_bytes" not in conf:
            raise ConfigError(f"{where}: capacity_bytes is required")
        policy = conf.get("eviction_policy", "lru")
        if not isinstance(policy, str):  # str() would turn 5 or null into the names '5' or 'None'
            raise ConfigError(f"{where}.eviction_policy must be a policy name (a string), got {policy!r}")
        try:  # checked before the directory is opened
            get_policy_class(policy)
        except ConfigError as e:
            raise ConfigError(f"{where}.eviction_policy: {e}") from None
        direct_io = conf.get("direct_io", True)
        if not isinstance(direct_io, bool):
            raise ConfigError(f"{where}: direct_io must be true or false, got {direct_io!r}")
        interval = conf.get("commit_interval_ms", DEFAULT_COMMIT_INTERVAL_MS)
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 < interval <= 60_000:
            raise ConfigError(f"{where}.commit_interval_ms must be a number of milliseconds in (0, 60000], "
                              f"got {interval!r}")
        return cls(
            path=os.fspath(path),
            capacity_bytes=parse_bytes(conf["capacity_bytes"], f"{where}.capacity_bytes"),
            slot_bytes=ctx.chunk_bytes,
            namespace=ctx.namespace,
            eviction_policy=policy,
            num_files=positive_int(conf.get("num_files", 4), f"{where}.num_files"),
            io_threads=thread_count(conf.get("io_threads", DEFAULT_IO_THREADS), f"{where}.io_threads"),
            direct_io=direct_io,
            commit_interval_ms=interval,
            commit_records=positive_int(conf.get("commit_records", DEFAULT_COMMIT_RECORDS),
                                        f"{where}.commit_records"),
            enable_events=ctx.enable_events,
            name=ctx.name,
        )

    def discard(self) -> None:
        """Stop and close; if nothing was stored since the open, also remove
        what it created (a namespace opened for nothing, a failed start)."""
        if self._worker is not None:
            self._worker.shutdown()
        self.store.discard()

    def get_manager(self) -> StorageOffloadingManager:
        return self._manager

    def get_worker(self, pool: HostPool) -> StorageWorker:
        if self._worker is None:
            self.store.allocate()  # the slab files take their space now, not at open
            self._worker = StorageWorker(self.store, pool, self.io_threads)
        return self._worker
