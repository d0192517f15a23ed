"""A host pool the TP ranks of a node share across processes.

HostPool maps anonymous private memory, so only threads of one process can
share it. SharedHostPool maps one file (best on a tmpfs such as /dev/shm)
MAP_SHARED instead: one process creates it, the other ranks open it by
path, and every CPUOffloadingWorker given it (`pool=`) sees the same chunk
slots. Same layout and API as HostPool; which rank writes which block is
the mappings' business (see kvoffload/layout.py).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import torch

from kvoffload.tiers.base import ALIGN, HostPool, align_up


class SharedHostPool(HostPool):
    """num_chunks chunk slots in a MAP_SHARED mapping of the file at `path`."""

    def __init__(self, path: str | os.PathLike, num_chunks: int, chunk_bytes: int, create: bool):
        if num_chunks <= 0 or chunk_bytes <= 0:
            raise ValueError(f"shared host pool needs chunks and bytes, got {num_chunks} x {chunk_bytes}")
        self.path, self.owner = Path(path), create
        self.num_chunks = num_chunks
        self.chunk_bytes = align_up(chunk_bytes)
        self.used_chunk_bytes = chunk_bytes
        size = self.num_chunks * self.chunk_bytes
        fd = os.open(self.path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)  # no room: an error now, not SIGBUS on a copy
            elif os.fstat(fd).st_size != size:
                raise ValueError(f"{self.path} holds {os.fstat(fd).st_size} bytes, not {num_chunks} chunks "
                                 f"of {self.chunk_bytes} B: the ranks disagree on the pool")
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            if create:
                self.path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8).reshape(self.num_chunks, self.chunk_bytes)
        if create:
            self.array[:, ::ALIGN] = 0  # allocate every page now, not on the copy path
        self.tensor = torch.from_numpy(self.array)
        self.pinned = False
        if torch.cuda.is_available():
            rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), size, 0)
            self.pinned = int(rc) == 0

    @classmethod
    def create(cls, path: str | os.PathLike, num_chunks: int, chunk_bytes: int) -> SharedHostPool:
        """A new pool file (refused if one exists: it may be another node's)."""
        return cls(path, num_chunks, chunk_bytes, create=True)

    @classmethod
    def open(cls, path: str | os.PathLike, num_chunks: int, chunk_bytes: int) -> SharedHostPool:
        """The pool another rank created, checked to have the same geometry."""
        return cls(path, num_chunks, chunk_bytes, create=False)

    def close(self) -> None:
        """Unpin; the creator also removes the file (mappings stay valid)."""
        super().close()
        if self.owner:
            self.path.unlink(missing_ok=True)
            self.owner = False
