"""What every tier shares: the host pool, the secondary-tier contract, and
the namespace that keeps blocks of different models/layouts apart.

The CPU tier is the primary: GPU <-> host pool. Secondary tiers (storage,
remote) move whole chunks between host-pool slots and their medium, so they
never touch GPU memory and a chunk is always one contiguous, 4 KiB-aligned
byte range (O_DIRECT- and zero-copy-send-ready).
"""

from __future__ import annotations

import hashlib
import json
import mmap
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvoffload.abstractions import (
    CPULoadStoreSpec,
    LoadStoreSpec,
    Locality,
    Medium,
    OffloadingManager,
    TransferResult,
)

ALIGN = 4096  # O_DIRECT and page alignment


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class HostPool:
    """num_chunks fixed-size chunk slots in one anonymous, page-aligned mmap.

    Allocated and touched once at start (first touch is slow on these
    machines), and pinned with cudaHostRegister when CUDA is present so
    device copies run asynchronously at full speed.
    """

    def __init__(self, num_chunks: int, chunk_bytes: int):
        if num_chunks <= 0:
            raise ValueError(f"host pool needs at least one chunk, got {num_chunks}")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.num_chunks = num_chunks
        self.chunk_bytes = align_up(chunk_bytes)
        self.used_chunk_bytes = chunk_bytes
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


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for stored bytes to mean the same KV.
    Tiers that outlive a process (storage, remote) never serve a block
    stored under another namespace."""

    model: str = "unknown"
    dtype: str = "unknown"
    layout: str = "unknown"  # e.g. the canonical page layout id
    block_size: int = 0  # tokens per chunk
    parallel_layout: str = "tp1"  # "agnostic" when pages are canonical
    chunk_bytes: int = 0

    def digest(self) -> str:
        """A short stable id, used in file names and remote key prefixes."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


class TierWorker(ABC):
    """Moves whole chunks between host-pool slots and a secondary medium."""

    @abstractmethod
    def submit_store(self, job_id: int, src: CPULoadStoreSpec, dst: LoadStoreSpec) -> bool:
        """Start writing host chunks src to the medium; False if refused."""

    @abstractmethod
    def submit_load(self, job_id: int, src: LoadStoreSpec, dst: CPULoadStoreSpec) -> bool:
        """Start reading chunks from the medium into host chunks dst."""

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call (failed ones with success=False)."""

    @abstractmethod
    def wait(self, job_ids: set[int]) -> None: ...

    def shutdown(self) -> None:
        return


class SecondaryTier(ABC):
    """A manager + worker pair below the CPU tier.

    The manager is an ordinary OffloadingManager whose specs its own worker
    understands. The worker is made once the host pool exists.
    """

    name: str
    medium: Medium
    locality: Locality

    @abstractmethod
    def get_manager(self) -> OffloadingManager: ...

    @abstractmethod
    def get_worker(self, pool: HostPool) -> TierWorker: ...
