"""What every tier shares: the secondary-tier contract, the namespace that
keeps blocks of different models/layouts apart, and the pool alignment
(the host pool itself: host_pool.py).

The CPU tier is the primary: GPU <-> host pool. Secondary tiers (storage,
remote) move whole chunks between host-pool slots and their medium, so they
never touch GPU memory and a chunk is always one contiguous, 4 KiB-aligned
byte range (O_DIRECT- and zero-copy-send-ready).
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from kvoffload.abstractions import (
    CPULoadStoreSpec,
    LoadStoreSpec,
    Locality,
    Medium,
    OffloadingManager,
    TransferResult,
)
from kvoffload.align import ALIGN, align_up  # noqa: F401 (re-exported for the tiers)

if TYPE_CHECKING:
    from kvoffload.tiers.host_pool import HostPool


def even_runs(n: int, k: int) -> list[tuple[int, int]]:
    """[a, b) runs splitting n items into k (>= 1) runs of near-equal length."""
    return [(i * n // k, (i + 1) * n // k) for i in range(k)]


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
