"""The storage tier's on-disk state: slab files of fixed-size slots plus the
persistent index, for one namespace under one directory.

Layout: <path>/ns-<namespace digest>/{namespace.json, index.log, slab-<i>.bin,
lock}. Slot s lives in slab s % num_files at offset (s // num_files) *
slot_bytes, so consecutive slots spread over the files (and the disk's queues).
Everything is created 0600 (directories 0700). One process at a time: a second
opener of the same directory gets a clear error rather than a shared mess.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from kvoffload.config import ConfigError
from kvoffload.tiers.base import ALIGN, Namespace
from kvoffload.tiers.storage.index import OP_FREE, OP_PUT, Geometry, IndexLog, pack

log = logging.getLogger(__name__)


class StorageError(ConfigError):
    """The storage directory cannot be used (named in the message)."""


class SlabStore:
    def __init__(self, path: str | os.PathLike, namespace: Namespace, slot_bytes: int,
                 num_slots: int, num_files: int = 4, direct_io: bool = True):
        if slot_bytes <= 0 or slot_bytes % ALIGN:
            raise ValueError(f"slot_bytes must be a positive multiple of {ALIGN}, got {slot_bytes}")
        if num_slots <= 0:
            raise StorageError(f"storage capacity holds no slot of {slot_bytes} bytes")
        self.namespace = namespace
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.num_files = max(1, min(num_files, num_slots))
        self.dir = Path(path) / f"ns-{namespace.digest()}"
        self.fds: list[int] = []
        self._lock_fd = -1
        try:
            self._open(direct_io)
        except OSError as e:
            self.close()
            raise StorageError(f"storage directory {self.dir}: {os.strerror(e.errno or 0)} "
                               f"({e.filename or self.dir})") from None
        except BaseException:
            self.close()
            raise
        # slot -> (key, checksum) of every durable entry; guarded by _lock
        self.durable = self.index.entries
        self._lock = threading.Lock()
        self._corrupt: list[int] = []
        self._syncer: ThreadPoolExecutor | None = None

    def _open(self, direct_io: bool) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StorageError(f"storage directory {self.dir} is in use by another process") from None
        meta = self.dir / "namespace.json"
        if meta.exists():
            if json.loads(meta.read_text()) != asdict(self.namespace):
                raise StorageError(f"{meta} records another namespace (digest collision)")
        else:
            fd = os.open(meta, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(self.namespace), f, sort_keys=True)
        slots_per_file = -(-self.num_slots // self.num_files)
        size = slots_per_file * self.slot_bytes
        self.direct_io = direct_io
        for i in range(self.num_files):
            fd = self._open_slab(self.dir / f"slab-{i}.bin", direct_io)
            self.fds.append(fd)
            if os.fstat(fd).st_size > size:
                os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise StorageError(f"storage directory {self.dir}: no space for "
                                       f"{self.num_files * size} bytes of slab files") from None
                raise
        geometry = Geometry(self.namespace.digest(), self.slot_bytes, self.num_files)
        self.index = IndexLog(self.dir / "index.log", geometry, self.num_slots)

    def _open_slab(self, path: Path, direct_io: bool) -> int:
        flags = os.O_RDWR | os.O_CREAT
        if direct_io:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                log.warning("%s: O_DIRECT not supported here; using buffered IO", path)
                self.direct_io = False
        return os.open(path, flags, 0o600)

    def locate(self, slot: int) -> tuple[int, int]:
        """(file descriptor, byte offset) of a slot."""
        return self.fds[slot % self.num_files], (slot // self.num_files) * self.slot_bytes

    # --- index updates (called by the worker's commit thread) ---

    def commit(self, puts: list[tuple[int, bytes, int]], frees: list[int]) -> None:
        """One durable index append for many jobs (group commit): PUT
        (slot, key, checksum) entries, whose bytes must already be durable,
        then FREEs of slots about to be overwritten (only those the index
        names). A slot can be in both: its new owner is evicted already."""
        put_slots = {s for s, _, _ in puts}
        with self._lock:
            held = [s for s in frees if s in self.durable or s in put_slots]
        records = [pack(OP_PUT, s, c, k) for s, k, c in puts]
        records += [pack(OP_FREE, s, 0, b"") for s in held]
        if records:
            self.index.append(b"".join(records))
        with self._lock:  # visible to loads only once durable
            for s, k, c in puts:
                self.durable[s] = (k, c)
            for s in held:
                self.durable.pop(s, None)

    def names_any(self, slots) -> bool:
        """Whether the index holds an entry for any of these slots."""
        with self._lock:
            return any(s in self.durable for s in slots)

    def expected_checksum(self, slot: int) -> int | None:
        with self._lock:
            entry = self.durable.get(slot)
        return None if entry is None else entry[1]

    def report_corrupt(self, slot: int) -> None:
        with self._lock:
            self._corrupt.append(slot)
            self.durable.pop(slot, None)
        try:
            self.index.append(pack(OP_FREE, slot, 0, b""))
        except OSError as e:
            log.warning("storage index: cannot record a freed slot: %s", e)

    def take_corrupt(self) -> list[int]:
        """Slots found corrupt since the last call (for the manager)."""
        if not self._corrupt:
            return []
        with self._lock:
            out, self._corrupt = self._corrupt, []
        return out

    def clear(self) -> None:
        with self._lock:
            self.durable.clear()
        self.index.clear()

    def sync_data(self, fds) -> None:
        """fdatasync the given slab files, concurrently: the filesystem
        journal folds concurrent syncs into one commit."""
        fds = list(fds)
        if len(fds) <= 1:
            for fd in fds:
                os.fdatasync(fd)
            return
        if self._syncer is None:
            self._syncer = ThreadPoolExecutor(self.num_files, thread_name_prefix="kvoffload-storage-sync")
        for f in [self._syncer.submit(os.fdatasync, fd) for fd in fds]:
            f.result()  # re-raises an OSError here

    def close(self) -> None:
        if getattr(self, "_syncer", None) is not None:
            self._syncer.shutdown()
            self._syncer = None
        if getattr(self, "index", None) is not None:
            self.index.close()
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
