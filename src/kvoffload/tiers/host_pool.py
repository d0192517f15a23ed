"""The host pool: fixed-size chunk slots in host memory, the CPU tier's
medium and the staging area every secondary tier reads and writes.

HostPool maps anonymous private memory, so only threads of one process can
share it. SharedHostPool maps one file (best on a tmpfs such as /dev/shm)
MAP_SHARED instead: one process creates it, the other TP ranks open it by
path, and every CPUOffloadingWorker given it (`pool=`) sees the same chunk
slots. Same layout and API as HostPool; which rank writes which block is
the mappings' business (see kvoffload/layout/).

A shared pool's file starts with one 4 KiB header page naming its geometry
(so a process that does not know the chunk size, such as vLLM's scheduler,
can read it: `geometry(path)`), then the chunk slots. It appears at `path`
only once complete (made under a temporary name, then linked), so a rank
that opens it never sees a half-made pool.
"""

from __future__ import annotations

import atexit
import mmap
import os
import struct
import time
import weakref
from pathlib import Path

import numpy as np
import torch

from kvoffload.align import ALIGN, align_up


def slot_bytes(chunk_bytes: int, trailer_bytes: int = 0) -> int:
    """A pool slot's stride: the chunk and the room kept after it, rounded up to 4 KiB (O_DIRECT)."""
    return align_up(chunk_bytes + trailer_bytes)


class HostPool:
    """num_chunks fixed-size chunk slots in one anonymous, page-aligned mmap.

    Allocated and touched once at start (first touch is slow on these
    machines), and pinned with cudaHostRegister when CUDA is present so
    device copies run asynchronously at full speed.
    """

    def __init__(self, num_chunks: int, chunk_bytes: int, trailer_bytes: int = 0):
        """trailer_bytes: room each slot keeps after its chunk_bytes (the
        Mooncake tier stores a value's header there, so chunk + header go out
        as one buffer); the stride still rounds up to 4 KiB for O_DIRECT."""
        if num_chunks <= 0:
            raise ValueError(f"host pool needs at least one chunk, got {num_chunks}")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        if trailer_bytes < 0:
            raise ValueError(f"trailer_bytes must be >= 0, got {trailer_bytes}")
        self.num_chunks = num_chunks
        self.chunk_bytes = slot_bytes(chunk_bytes, trailer_bytes)
        self.used_chunk_bytes = chunk_bytes
        self.trailer_bytes = trailer_bytes
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self._adopt(mmap.mmap(-1, self.nbytes, flags=flags), touch=True)

    def _adopt(self, mm: mmap.mmap, touch: bool) -> None:
        """Make mm the chunk slots: array and tensor views on it, every page
        touched now (not on the copy path) if asked, pinned when CUDA is here."""
        self._mmap = mm
        self.array = np.frombuffer(mm, dtype=np.uint8).reshape(self.num_chunks, self.chunk_bytes)
        if touch:
            self.array[:, :: ALIGN] = 0
        self.tensor = torch.from_numpy(self.array)  # shares the mmap
        self.pinned = False
        if torch.cuda.is_available():
            rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
            self.pinned = int(rc) == 0

    @property
    def nbytes(self) -> int:
        return self.num_chunks * self.chunk_bytes

    def chunk(self, idx: int) -> np.ndarray:
        """The bytes of one chunk slot (a view, no copy)."""
        return self.array[idx]

    def chunk_memoryview(self, idx: int) -> memoryview:
        return memoryview(self._mmap)[idx * self.chunk_bytes : (idx + 1) * self.chunk_bytes]

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False



MAGIC = b"KVOFFLOAD-POOL-1"
_HEADER = struct.Struct("<16sQQ")  # magic, num_chunks, used chunk bytes


def _read_header(fd: int, path: Path) -> tuple[int, int]:
    magic, num_chunks, chunk_bytes = _HEADER.unpack(os.pread(fd, _HEADER.size, 0).ljust(_HEADER.size, b"\0"))
    if magic != MAGIC:
        raise ValueError(f"{path} is not a kvoffload shared host pool (no header)")
    return num_chunks, chunk_bytes


def _wait_for(path: Path, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() >= deadline:
            raise FileNotFoundError(f"no shared host pool at {path} after {wait_s:g} s: "
                                    "the rank that creates it (TP rank 0) did not")
        time.sleep(0.01)


def _remove_at_exit(pool_ref: weakref.ref, creator_pid: int) -> None:
    pool = pool_ref()
    if pool is not None and os.getpid() == creator_pid:
        pool.remove_file()


class SharedHostPool(HostPool):
    """num_chunks chunk slots in a MAP_SHARED mapping of the file at `path`."""

    def __init__(self, path: str | os.PathLike, num_chunks: int, chunk_bytes: int, create: bool,
                 trailer_bytes: int = 0):
        if num_chunks <= 0 or chunk_bytes <= 0 or trailer_bytes < 0:
            raise ValueError(f"shared host pool needs chunks and bytes, got {num_chunks} x {chunk_bytes} "
                             f"(trailer {trailer_bytes})")
        self.path, self.owner = Path(path), create
        self.num_chunks = num_chunks
        self.chunk_bytes = slot_bytes(chunk_bytes, trailer_bytes)
        self.used_chunk_bytes = chunk_bytes
        self.trailer_bytes = trailer_bytes
        size = self.num_chunks * self.chunk_bytes
        if create:
            if self.path.exists():  # early and clear; the link below is the real check
                raise FileExistsError(f"{self.path} exists: another engine may use it (remove it if not)")
            made = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            fd = os.open(made, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        else:
            fd = os.open(self.path, os.O_RDWR)
        try:
            if create:
                try:  # no room: an error now, not SIGBUS on a copy
                    os.posix_fallocate(fd, 0, ALIGN + size)
                except OSError as e:
                    raise OSError(e.errno, f"cannot make a shared host pool of {ALIGN + size} bytes at "
                                  f"{self.path}: {e.strerror} (a container's /dev/shm is often small: "
                                  "raise --shm-size, lower cpu_bytes_to_use or set shared_pool_path)") from None
                os.pwrite(fd, _HEADER.pack(MAGIC, num_chunks, chunk_bytes), 0)
            elif (have := _read_header(fd, self.path)) != (num_chunks, chunk_bytes):
                raise ValueError(f"{self.path} holds {have} (chunks, bytes), not "
                                 f"{num_chunks} chunks of {chunk_bytes} B: the ranks disagree on the pool")
            elif os.fstat(fd).st_size != ALIGN + size:  # the slot stride (trailer room) differs
                raise ValueError(f"{self.path} is {os.fstat(fd).st_size} bytes, not {ALIGN + size} "
                                 f"({num_chunks} slots of {self.chunk_bytes} B): the ranks disagree on the pool")
            self._adopt(mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                  offset=ALIGN), touch=create)  # the creator allocates every page
            if create:
                os.link(made, self.path)  # appears complete; FileExistsError if another made it meanwhile
                # vLLM SIGTERMs a rank that lingers at shutdown (SystemExit: atexit runs) before
                # its connector may close us; a forked child inherits this but is not the creator
                atexit.register(_remove_at_exit, weakref.ref(self), os.getpid())
        finally:
            os.close(fd)
            if create:
                made.unlink(missing_ok=True)

    @classmethod
    def create(cls, path: str | os.PathLike, num_chunks: int, chunk_bytes: int,
               trailer_bytes: int = 0) -> SharedHostPool:
        """A new pool file (refused if one exists: it may be another node's)."""
        return cls(path, num_chunks, chunk_bytes, create=True, trailer_bytes=trailer_bytes)

    @classmethod
    def open(cls, path: str | os.PathLike, num_chunks: int | None = None, chunk_bytes: int | None = None,
             wait_s: float = 0.0, trailer_bytes: int = 0) -> SharedHostPool:
        """The pool another rank created, checked to have the given geometry
        (None: whatever it has); waits up to wait_s for it to appear."""
        if num_chunks is None or chunk_bytes is None:
            have = cls.geometry(path, wait_s)
            num_chunks, chunk_bytes = num_chunks or have[0], chunk_bytes or have[1]
        else:
            _wait_for(Path(path), wait_s)
        return cls(path, num_chunks, chunk_bytes, create=False, trailer_bytes=trailer_bytes)

    @staticmethod
    def geometry(path: str | os.PathLike, wait_s: float = 0.0) -> tuple[int, int]:
        """(num_chunks, chunk_bytes) of the pool at path, waiting up to wait_s for it."""
        path = Path(path)
        _wait_for(path, wait_s)
        fd = os.open(path, os.O_RDONLY)
        try:
            return _read_header(fd, path)
        finally:
            os.close(fd)

    def remove_file(self) -> None:
        """The creator removes the file; mappings stay valid. First thing at
        shutdown: what follows may be slow (IO threads finishing), and an
        engine killed meanwhile would leave the file, which refuses the next
        start at this path."""
        if self.owner:
            self.path.unlink(missing_ok=True)
            self.owner = False

    def close(self) -> None:
        """Unpin; the creator also removes the file (mappings stay valid)."""
        super().close()
        self.remove_file()
