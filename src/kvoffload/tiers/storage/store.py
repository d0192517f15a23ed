"""The storage tier's on-disk state: slab files of fixed-size slots plus the
persistent index, for one namespace under one directory.

Layout: <path>/ns-<namespace digest>/{namespace.json, index.log, slab-<i>.bin,
lock}. Slot s lives in slab s % num_files at offset (s // num_files) *
slot_bytes, so consecutive slots spread over the files (and the disk's queues).
Everything is created 0600 (directories 0700). One process at a time: a second
opener of the same directory gets a clear error rather than a shared mess.
The slab files are made and sized (fallocate) at allocate(), when the worker
is made, not at open: an open only reads the index.

Durability (a cache needs integrity, not the durability of each block):
- A store is acknowledged once its bytes are written to its slot; its index
  record (slot, key, xxh3 of the bytes) is queued and written by the group
  commit (commit.py): every `commit_interval_ms`, or sooner once
  `commit_records` wait, and at close. A commit first fdatasyncs the slab
  files written since the last one, then appends the records and fdatasyncs
  the log: a record on disk names bytes on disk.
- A reused slot gets no record before it is overwritten: its old record
  stays until the new one is committed, and names the old bytes' checksum.
- Every load compares the slot's bytes with the checksum its record names.
So a `kill -9` costs at most the stores acknowledged in the last commit
interval (their records were not written yet): they are misses after a
restart, as is a slot overwritten in that interval whose old record is still
there (a checksum mismatch, counted as a checksum failure). A power loss
costs the same (what the last commit made durable survives). A torn or stale
slot never matches its record's checksum: a wrong byte is never served (short
of a 64-bit hash collision). After a clean close nothing is lost.

The directory is opened once (O_NOFOLLOW) and refused unless this user owns
it and nobody else can write it; every file in it is opened relative to that
descriptor, never through a symbolic link, and refused unless a regular
file of this user with one link (a hard link's other name could be written
through); temporary files are created exclusively: another user who guessed
the (computable) directory name cannot make us write through links they
planted. A failed open removes what it created; so does discard(), for an
open that stored nothing.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import logging
import os
import weakref
from dataclasses import asdict
from pathlib import Path

from kvoffload.align import ALIGN
from kvoffload.tiers.base import Namespace
from kvoffload.tiers.storage.commit import IndexedSlots
from kvoffload.tiers.storage.files import (  # noqa: F401 (StorageError, open_dir: re-exported)
    _NOFOLLOW, _OPEN, _OPEN_LOCK, StorageError, make_dirs, open_dir, refuse_unless_own, remove_made,
)
from kvoffload.tiers.storage.index import RECORD_BYTES, Geometry, IndexLog, open_regular, write_atomically

log = logging.getLogger(__name__)

# stores open in this process: at exit each commits what waits, or, having
# stored nothing, removes what it created (an engine whose start failed after
# the tiers were built exits with nothing of theirs left behind)
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _at_exit() -> None:
    for store in list(_LIVE):
        try:
            store.release_at_exit()
        except Exception:  # best effort at exit: never a traceback there
            log.debug("storage directory %s: not released at exit", store.dir, exc_info=True)


class SlabStore(IndexedSlots):
    def __init__(self, path: str | os.PathLike, namespace: Namespace, slot_bytes: int,
                 num_slots: int, num_files: int = 4, direct_io: bool = True,
                 commit_interval_s: float = 0.1, commit_records: int = 4096):
        if slot_bytes <= 0 or slot_bytes % ALIGN:
            raise ValueError(f"slot_bytes must be a positive multiple of {ALIGN}, got {slot_bytes}")
        if num_slots <= 0:
            raise StorageError(f"storage capacity holds no slot of {slot_bytes} bytes")
        self.namespace = namespace
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.num_files = max(1, min(num_files, num_slots))
        self.dir = Path(path) / f"ns-{namespace.digest()}"
        self.direct_io = direct_io
        self.commit_records = max(1, commit_records)
        self.fds: list[int] = []  # -1 until allocate() makes a missing slab file
        self.index: IndexLog | None = None
        self._dir_fd = -1
        self._dir_id: tuple[int, int] | None = None
        self._lock_fd = -1
        self._syncer = None  # a ThreadPoolExecutor for sync_data, made at first use
        self._flusher = None
        self._allocated = False
        # what this open (and allocate()) made, undone if it fails or by discard()
        self._made_dirs: list[Path] = []
        self._made_files: list[str] = []
        self._grown: dict[str, int] = {}  # slab name -> size before we grew it
        try:
            self._open()
        except OSError as e:
            self._undo()
            raise self._named(e) from None
        except BaseException:
            self._undo()
            raise
        self._init_entries(commit_interval_s)
        _LIVE.add(self)

    def _named(self, e: OSError) -> StorageError:
        # files are opened relative to the directory: name them in full
        name = self.dir / e.filename if isinstance(e.filename, str) else self.dir
        if e.errno == errno.ELOOP:
            return StorageError(f"{name} is a symbolic link: refusing to follow it")
        return StorageError(f"storage directory {self.dir}: {e.strerror or os.strerror(e.errno or 0)} ({name})")

    def _open(self) -> None:
        self._made_dirs = make_dirs(self.dir)
        self._dir_fd = dfd = open_dir(self.dir)
        st = os.fstat(dfd)
        with _OPEN_LOCK:
            if (st.st_dev, st.st_ino) in _OPEN:
                raise StorageError(f"storage directory {self.dir} is already open in this process "
                                   "(the same path configured twice?)")
            _OPEN.add((st.st_dev, st.st_ino))
        self._dir_id = (st.st_dev, st.st_ino)
        for name in ("lock", "namespace.json", IndexLog.NAME, *self._slab_names()):
            self._refuse_foreign(name)
        self._lock_fd = self._open_file("lock", os.O_RDWR)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StorageError(f"storage directory {self.dir} is in use by another process") from None
        self._check_namespace()
        self._check_space(self._slab_size())
        for name in self._slab_names():  # the ones there are opened (checked) now, the rest made by allocate()
            self.fds.append(self._open_slab(name) if self._exists(name) else -1)
        geometry = Geometry(self.namespace.digest(), self.slot_bytes, self.num_files)
        if not self._exists(IndexLog.NAME):
            if any(fd >= 0 for fd in self.fds):
                log.warning("%s: no %s beside its slab files: the chunks in them are lost (misses)",
                            self.dir, IndexLog.NAME)
            self._made_files.append(IndexLog.NAME)
        self.index = IndexLog(dfd, geometry, self.num_slots)
        if self.index.bad_records:
            log.warning("%s/%s: %d damaged records skipped (their chunks are misses)",
                        self.dir, IndexLog.NAME, self.index.bad_records)

    def _slab_names(self) -> list[str]:
        return [f"slab-{i}.bin" for i in range(self.num_files)]

    def _slab_size(self) -> int:
        return -(-self.num_slots // self.num_files) * self.slot_bytes

    def allocate(self) -> None:
        """Make the missing slab files and size them all to the capacity
        (once; the worker calls it): until then the open holds no disk space."""
        if self._allocated:
            return
        size = self._slab_size()
        try:
            for i, name in enumerate(self._slab_names()):
                if self.fds[i] < 0:
                    self.fds[i] = self._open_slab(name)
                fd = self.fds[i]
                have = os.fstat(fd).st_size
                if have > size:
                    os.ftruncate(fd, size)
                elif have < size and name not in self._made_files:
                    self._grown.setdefault(name, have)
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    if e.errno == errno.ENOSPC:
                        raise StorageError(f"storage directory {self.dir}: no space for "
                                           f"{self.num_files * size} bytes of slab files") from None
                    raise
        except OSError as e:
            self._give_back_slabs()
            raise self._named(e) from None
        except BaseException:
            self._give_back_slabs()
            raise
        self._allocated = True

    def _give_back_slabs(self) -> None:
        """Remove the slab files this open made and shrink the ones it grew."""
        for i, name in enumerate(self._slab_names()):
            if name in self._made_files or name in self._grown:
                if self.fds[i] >= 0:
                    os.close(self.fds[i])
                    self.fds[i] = -1
        remove_made(self._dir_fd, [n for n in self._made_files if n.startswith("slab-")],
                          {n: size for n, size in self._grown.items()})
        self._made_files = [n for n in self._made_files if not n.startswith("slab-")]
        self._grown = {}

    def _exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def _refuse_foreign(self, name: str) -> None:
        try:
            st = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        refuse_unless_own(self.dir / name, st)

    def _open_file(self, name: str, flags: int) -> int:
        """Open (creating it if missing) a regular file of ours in the directory."""
        try:
            fd = os.open(name, flags | _NOFOLLOW, dir_fd=self._dir_fd)
        except FileNotFoundError:
            fd = os.open(name, flags | _NOFOLLOW | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=self._dir_fd)
            self._made_files.append(name)
        try:
            refuse_unless_own(self.dir / name, os.fstat(fd))
        except StorageError:
            os.close(fd)
            raise
        return fd

    def _check_namespace(self) -> None:
        """namespace.json guards the chunks: missing, empty or damaged, it is
        written afresh only where the directory holds no chunk (no index
        entry, no slab file); else the open is refused."""
        meta = self.dir / "namespace.json"
        want = asdict(self.namespace)
        try:
            fd = open_regular("namespace.json", self._dir_fd)
        except FileNotFoundError:
            fd, raw, what = -1, b"", "missing"
        else:
            with os.fdopen(fd, "rb") as f:
                raw = f.read(1 << 16)
            what = "empty" if not raw.strip() else "damaged (not a JSON object)"
        try:
            got = json.loads(raw) if fd >= 0 else None
        except (ValueError, RecursionError):  # RecursionError: arrays nested thousands deep
            got = None
        if isinstance(got, dict):
            if got != want:
                raise StorageError(f"{meta} records another namespace (digest collision)")
            return
        if self._holds_chunks():
            raise StorageError(f"{meta} is {what}: it guards the chunks in {self.dir}; "
                               "restore it, or delete that directory to start afresh")
        if fd >= 0:
            log.warning("%s was %s and the directory holds no chunk: rewritten", meta, what)
        else:
            self._made_files.append("namespace.json")
        self._write_namespace()

    def _holds_chunks(self) -> bool:
        if any(self._exists(n) for n in self._slab_names()):
            return True
        try:
            st = os.stat(IndexLog.NAME, dir_fd=self._dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return st.st_size > RECORD_BYTES  # more than a header

    def _write_namespace(self) -> None:
        blob = json.dumps(asdict(self.namespace), sort_keys=True).encode()
        write_atomically(self._dir_fd, "namespace.json", [blob])

    def _check_space(self, size: int) -> None:
        """Refuse a capacity the filesystem cannot hold before creating anything."""
        need = 0
        for name in self._slab_names():
            try:
                st = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
                need += max(0, size - st.st_blocks * 512)
            except FileNotFoundError:
                need += size
        vfs = os.fstatvfs(self._dir_fd)
        free = vfs.f_bavail * vfs.f_frsize
        if need > free:
            raise StorageError(f"storage directory {self.dir}: capacity needs {need} more bytes of slab "
                               f"files, its filesystem has {free} free; lower capacity_bytes")

    def _undo(self) -> None:
        """Close, and remove what this open (and allocate()) created."""
        grown, made, dirs = self._grown, self._made_files, self._made_dirs
        dfd = os.dup(self._dir_fd) if self._dir_fd >= 0 else -1
        self._close_files()
        if dfd >= 0:
            remove_made(dfd, made, grown)
            os.close(dfd)
        for d in reversed(dirs):
            try:
                os.rmdir(d)
            except OSError:
                break  # not empty (someone else's files) or gone: leave it
        self._made_dirs, self._made_files, self._grown = [], [], {}

    def discard(self) -> None:
        """Close; if nothing was stored since the open, also remove what it
        created (a namespace opened for a layout that turned out another, or
        a start that failed): no unused directory or slab file is left."""
        _LIVE.discard(self)
        if self._stored:
            self.close()
            return
        self._stop_flusher(commit=False)
        self._undo()

    def release_at_exit(self) -> None:
        """discard() for a process that exits: the files are not closed (an
        IO thread may still be writing, and a closed descriptor's number
        could be reused under it); the kernel closes them."""
        if self._stored:
            self.flush()
            return
        self._stop_flusher(commit=False)
        if self._dir_fd >= 0:
            remove_made(self._dir_fd, self._made_files, self._grown)
        for d in reversed(self._made_dirs):
            try:
                os.rmdir(d)
            except OSError:
                break

    def _open_slab(self, name: str) -> int:
        existed = self._exists(name)
        if self.direct_io:
            try:
                return self._open_file(name, os.O_RDWR | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                log.warning("%s: O_DIRECT not supported here; using buffered IO", self.dir / name)
                self.direct_io = False
        fd = self._open_file(name, os.O_RDWR)
        if not existed and name not in self._made_files:  # made by the refused O_DIRECT open
            self._made_files.append(name)
        return fd

    def locate(self, slot: int) -> tuple[int, int]:
        """(file descriptor, byte offset) of a slot."""
        return self.fds[slot % self.num_files], (slot // self.num_files) * self.slot_bytes

    def close(self) -> None:
        """Commit what waits, then release everything (a clean close loses nothing)."""
        _LIVE.discard(self)
        self._stop_flusher(commit=True)
        self._close_files()
        self._made_dirs, self._made_files, self._grown = [], [], {}  # kept: a later discard() removes nothing

    def _close_files(self) -> None:
        if self._syncer is not None:
            self._syncer.shutdown()
            self._syncer = None
        if self.index is not None:
            self.index.close()
            self.index = None
        for fd in self.fds:
            if fd >= 0:
                os.close(fd)
        self.fds = []
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1
        if self._dir_id is not None:
            with _OPEN_LOCK:
                _OPEN.discard(self._dir_id)
            self._dir_id = None
