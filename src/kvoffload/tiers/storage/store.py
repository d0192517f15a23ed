"""The storage tier's on-disk state: slab files of fixed-size slots plus the
persistent index, for one namespace under one directory.

Layout: <path>/ns-<namespace digest>/{namespace.json, index.log, slab-<i>.bin,
lock}. Slot s lives in slab s % num_files at offset (s // num_files) *
slot_bytes, so consecutive slots spread over the files (and the disk's queues).
Everything is created 0600 (directories 0700). One process at a time: a second
opener of the same directory gets a clear error rather than a shared mess.

The directory is opened once (O_NOFOLLOW) and refused unless this user owns
it and nobody else can write it; every file in it is opened relative to that
descriptor, never through a symbolic link, and temporary files are created
exclusively: another user who guessed the (computable) directory name cannot
make us write through links they planted. A failed open removes what it
created.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from kvoffload.config import ConfigError
from kvoffload.align import ALIGN
from kvoffload.tiers.base import Namespace
from kvoffload.tiers.storage.index import (
    OP_FREE, OP_PUT, RECORD_BYTES, Geometry, IndexLog, open_regular, write_atomically,
)

log = logging.getLogger(__name__)

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
# (st_dev, st_ino) of the directories open in this process: a second opener
# here is told that, not "another process"
_OPEN: set[tuple[int, int]] = set()
_OPEN_LOCK = threading.Lock()


class StorageError(ConfigError):
    """The storage directory cannot be used (named in the message)."""


def open_dir(path: Path) -> int:
    """An O_NOFOLLOW descriptor of a storage directory this user owns and
    nobody else can write; StorageError (one line) otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
            raise StorageError(f"storage directory {path} is a symbolic link: refusing it "
                               "(point path at the real directory)") from None
        raise
    st = os.fstat(fd)
    uid = os.geteuid()
    if st.st_uid != uid:
        os.close(fd)
        raise StorageError(f"storage directory {path} belongs to uid {st.st_uid}, not to this "
                           f"process (uid {uid}): refusing it, another user could have planted "
                           "links there; remove it or choose another path")
    if st.st_mode & 0o022:
        os.close(fd)
        raise StorageError(f"storage directory {path} is writable by others (mode "
                           f"{stat.S_IMODE(st.st_mode):04o}): refusing it; `chmod go-w` it or remove it")
    return fd


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
        self.index: IndexLog | None = None
        self._dir_fd = -1
        self._dir_id: tuple[int, int] | None = None
        self._lock_fd = -1
        self._syncer: ThreadPoolExecutor | None = None
        # what this open made, undone if it fails
        self._made_dirs: list[Path] = []
        self._made_files: list[str] = []
        self._grown: dict[str, int] = {}  # slab name -> size before we grew it
        try:
            self._open(direct_io)
        except OSError as e:
            self._undo()
            # files are opened relative to the directory: name them in full
            name = self.dir / e.filename if isinstance(e.filename, str) else self.dir
            if e.errno == errno.ELOOP:
                raise StorageError(f"{name} is a symbolic link: refusing to follow it") from None
            raise StorageError(f"storage directory {self.dir}: {e.strerror or os.strerror(e.errno or 0)} "
                               f"({name})") from None
        except BaseException:
            self._undo()
            raise
        self._made_dirs, self._made_files, self._grown = [], [], {}
        # slot -> (key, checksum) of every durable entry; guarded by _lock
        self.durable = self.index.entries
        self.bad_index_records = self.index.bad_records
        self._lock = threading.Lock()
        self._commit_lock = threading.Lock()  # orders index appends and compactions
        self._corrupt: list[tuple[int, str]] = []  # (slot, counter)
        self._loaded = 0  # blocks of successful loads, counted by the worker

    def _make_dirs(self) -> None:
        missing = []
        p = self.dir
        while not os.path.lexists(p):
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o700 if d == self.dir else 0o777)
            except FileExistsError:
                continue
            self._made_dirs.append(d)

    def _open(self, direct_io: bool) -> None:
        self._make_dirs()
        self._dir_fd = dfd = open_dir(self.dir)
        st = os.fstat(dfd)
        with _OPEN_LOCK:
            if (st.st_dev, st.st_ino) in _OPEN:
                raise StorageError(f"storage directory {self.dir} is already open in this process "
                                   "(the same path configured twice?)")
            _OPEN.add((st.st_dev, st.st_ino))
        self._dir_id = (st.st_dev, st.st_ino)
        self._lock_fd = self._open_file("lock", os.O_RDWR)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StorageError(f"storage directory {self.dir} is in use by another process") from None
        self._check_namespace()
        slots_per_file = -(-self.num_slots // self.num_files)
        size = slots_per_file * self.slot_bytes
        self._check_space(size)
        self.direct_io = direct_io
        for i in range(self.num_files):
            name = f"slab-{i}.bin"
            fd = self._open_slab(name, direct_io)
            self.fds.append(fd)
            have = os.fstat(fd).st_size
            if have > size:
                os.ftruncate(fd, size)
            elif have < size and name not in self._made_files:
                self._grown[name] = have
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise StorageError(f"storage directory {self.dir}: no space for "
                                       f"{self.num_files * size} bytes of slab files") from None
                raise
        geometry = Geometry(self.namespace.digest(), self.slot_bytes, self.num_files)
        if not self._exists(IndexLog.NAME):
            self._made_files.append(IndexLog.NAME)
        self.index = IndexLog(dfd, geometry, self.num_slots)
        if self.index.bad_records:
            log.warning("%s/%s: %d damaged records skipped (their chunks are misses)",
                        self.dir, IndexLog.NAME, self.index.bad_records)

    def _exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def _open_file(self, name: str, flags: int) -> int:
        """Open (creating it if missing) a regular file of ours in the directory."""
        try:
            fd = os.open(name, flags | _NOFOLLOW, dir_fd=self._dir_fd)
        except FileNotFoundError:
            fd = os.open(name, flags | _NOFOLLOW | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=self._dir_fd)
            self._made_files.append(name)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            raise StorageError(f"{self.dir / name} is not a regular file of this user: refusing it")
        return fd

    def _check_namespace(self) -> None:
        meta = self.dir / "namespace.json"
        want = asdict(self.namespace)
        try:
            fd = open_regular("namespace.json", self._dir_fd)
        except FileNotFoundError:
            self._write_namespace()
            self._made_files.append("namespace.json")
            return
        with os.fdopen(fd, "rb") as f:
            raw = f.read(1 << 16)
        try:
            got = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: arrays nested thousands deep
            got = None
        if not isinstance(got, dict):
            what = "empty" if not raw.strip() else "damaged (not a JSON object)"
            if self._index_empty():  # nothing here is served without it: safe to rebuild
                log.warning("%s was %s and no chunk is indexed: rewritten", meta, what)
                self._write_namespace()
                return
            raise StorageError(f"{meta} is {what}: it guards the chunks indexed in {self.dir}; "
                               "restore it, or delete that directory to start afresh")
        if got != want:
            raise StorageError(f"{meta} records another namespace (digest collision)")

    def _index_empty(self) -> bool:
        try:
            st = os.stat(IndexLog.NAME, dir_fd=self._dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return True
        return st.st_size <= RECORD_BYTES  # a header at most

    def _write_namespace(self) -> None:
        blob = json.dumps(asdict(self.namespace), sort_keys=True).encode()
        write_atomically(self._dir_fd, "namespace.json", [blob])

    def _check_space(self, size: int) -> None:
        """Refuse a capacity the filesystem cannot hold before creating anything."""
        need = 0
        for i in range(self.num_files):
            try:
                st = os.stat(f"slab-{i}.bin", dir_fd=self._dir_fd, follow_symlinks=False)
                need += max(0, size - st.st_blocks * 512)
            except FileNotFoundError:
                need += size
        vfs = os.fstatvfs(self._dir_fd)
        free = vfs.f_bavail * vfs.f_frsize
        if need > free:
            raise StorageError(f"storage directory {self.dir}: capacity needs {need} more bytes of slab "
                               f"files, its filesystem has {free} free; lower capacity_bytes")

    def _undo(self) -> None:
        """After a failed open: close, and remove what this open created."""
        grown, made, dirs = self._grown, self._made_files, self._made_dirs
        dfd = os.dup(self._dir_fd) if self._dir_fd >= 0 else -1
        self.close()
        if dfd >= 0:
            for name, size in grown.items():
                try:
                    fd = os.open(name, os.O_WRONLY | _NOFOLLOW, dir_fd=dfd)
                    try:
                        os.ftruncate(fd, size)
                    finally:
                        os.close(fd)
                except OSError:
                    pass
            for name in made:
                try:
                    os.unlink(name, dir_fd=dfd)
                except OSError:
                    pass
            os.close(dfd)
        for d in reversed(dirs):
            try:
                os.rmdir(d)
            except OSError:
                break  # not empty (someone else's files) or gone: leave it

    def _open_slab(self, name: str, direct_io: bool) -> int:
        existed = self._exists(name)
        if direct_io:
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

    # --- index updates (called by the worker's commit thread) ---

    def commit(self, puts: list[tuple[int, bytes, int]], frees: list[int]) -> None:
        """One durable index append for many jobs (group commit): PUT
        (slot, key, checksum) entries, whose bytes must already be durable,
        then FREEs of slots about to be overwritten (only those the index
        names). A slot can be in both: its new owner is evicted already.
        Raises OSError with nothing applied if the records are not all
        durable."""
        put_slots = {s for s, _, _ in puts}
        with self._commit_lock:
            with self._lock:
                held = [s for s in frees if s in self.durable or s in put_slots]
            pack = self.index.pack
            records = [pack(OP_PUT, s, c, k) for s, k, c in puts]
            records += [pack(OP_FREE, s) for s in held]
            if records or self.index.dirty:
                self._append(b"".join(records))
            with self._lock:  # visible to loads only once durable
                for s, k, c in puts:
                    self.durable[s] = (k, c)
                for s in held:
                    self.durable.pop(s, None)
            self._maybe_compact()

    def _append(self, records: bytes) -> None:
        """Append durably (the caller holds _commit_lock); a dirty log is
        first replaced by the durable entries, so no record a failed append
        left behind can name a slot about to be overwritten."""
        if self.index.dirty:
            with self._lock:
                snapshot = list(self.durable.items())
            self.index.rewrite(snapshot)
        if records:
            self.index.append(records)

    def _maybe_compact(self) -> None:
        """Rewrite the log as the live entries once it outgrows them (the
        caller holds _commit_lock, so no append can fall between the
        snapshot and the rename)."""
        if not self.index.needs_compaction(len(self.durable)):
            return
        with self._lock:
            snapshot = list(self.durable.items())
        try:
            self.index.rewrite(snapshot)
        except OSError as e:  # the old log is intact: try again on a later commit
            log.warning("storage index %s: compaction failed: %s", self.dir, e)

    def names_any(self, slots) -> bool:
        """Whether the index holds an entry for any of these slots (a dirty
        log may hold anything: a store then passes a commit, which fixes it)."""
        if self.index.dirty:
            return True
        with self._lock:
            return any(s in self.durable for s in slots)

    def expected_checksum(self, slot: int) -> int | None:
        with self._lock:
            entry = self.durable.get(slot)
        return None if entry is None else entry[1]

    def report_corrupt(self, slot: int, counter: str = "checksum_failures") -> None:
        """A slot that is bad (counter says how): dropped, never served again."""
        with self._commit_lock:
            with self._lock:
                self._corrupt.append((slot, counter))
                self.durable.pop(slot, None)
            try:
                self._append(self.index.pack(OP_FREE, slot))
            except OSError as e:
                log.warning("storage index: cannot record a freed slot: %s", e)

    def take_corrupt(self) -> list[tuple[int, str]]:
        """(slot, counter) of the slots found bad since the last call (for the manager)."""
        if not self._corrupt:
            return []
        with self._lock:
            out, self._corrupt = self._corrupt, []
        return out

    def count_loaded(self, n: int) -> None:
        with self._lock:
            self._loaded += n

    def take_loaded(self) -> int:
        with self._lock:
            n, self._loaded = self._loaded, 0
        return n

    def clear(self) -> None:
        """Forget every entry, on disk too: the log is cut to its header, which
        needs no free space (a reset must hold on a full disk)."""
        with self._commit_lock:
            with self._lock:
                self.durable.clear()
            self.index.void()

    def forget(self, slots: list[int]) -> None:
        """Forget these slots (a reset keeping the rest), on disk too. If their
        FREEs cannot be written (a full disk), the log is cut to its header
        instead: the kept entries are then missing on disk (misses after a
        restart, never stale blocks) until the next commit rewrites it."""
        try:
            self.commit([], slots)
        except OSError as e:
            with self._commit_lock:
                with self._lock:
                    for s in slots:
                        self.durable.pop(s, None)
                    kept = len(self.durable)
                self.index.void()
                self.index.dirty = True  # put the kept entries back with the next commit
            log.warning("storage index %s: cannot record a cache reset (%s): index emptied on disk instead "
                        "(%d blocks still in use are misses after a restart until the next store)",
                        self.dir, e.strerror or e, kept)

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
        if self._syncer is not None:
            self._syncer.shutdown()
            self._syncer = None
        if self.index is not None:
            self.index.close()
        for fd in self.fds:
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
