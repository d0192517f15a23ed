"""The worker-side contracts: where blocks are (load/store specs), the
engine's KV caches as a worker sees them (canonical block tensors), and the
OffloadingWorker that moves bytes between them and reports TransferResults.
Re-exported by kvoffload.abstractions, where users import them from; this
module imports nothing of ours, so the scheduler-side contracts can name
these types without an import cycle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "LoadStoreSpec", "BlockIDsLoadStoreSpec", "GPULoadStoreSpec", "CPULoadStoreSpec",
    "CanonicalKVCacheTensor", "CopyRun", "CanonicalPageMapping", "CanonicalKVCacheRef",
    "CanonicalKVCaches", "TransferResult", "OffloadingWorker",
]


class LoadStoreSpec:
    """Opaque to the scheduler: tells a worker where blocks are (or will be)."""


class BlockIDsLoadStoreSpec(LoadStoreSpec, ABC):
    """Blocks named by index. GPU specs hold GPU block ids; CPU specs hold
    host-pool chunk slots."""

    def __init__(self, block_ids: Sequence[int] | np.ndarray):
        self.block_ids = np.asarray(block_ids, dtype=np.int64)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.block_ids.tolist()!r})"


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """GPU blocks to read from or write into.

    With several KV groups the ids are ordered by group and group_sizes[i]
    says how many belong to group i. block_indices[i] is the logical index
    (within the request) of group i's first block: when an offloaded chunk
    spans several GPU blocks, the first GPU block may start mid-chunk, and
    this says how much of the first chunk to skip.
    """

    def __init__(
        self,
        block_ids: Sequence[int] | np.ndarray,
        group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
    ):
        super().__init__(block_ids)
        if group_sizes is None:
            group_sizes = (len(self.block_ids),)
        if block_indices is None:
            block_indices = (0,) * len(group_sizes)
        if sum(group_sizes) != len(self.block_ids):
            raise ValueError(
                f"group_sizes {list(group_sizes)} sum to {sum(group_sizes)}, "
                f"but there are {len(self.block_ids)} block ids"
            )
        if len(block_indices) != len(group_sizes):
            raise ValueError(
                f"block_indices has {len(block_indices)} entries for {len(group_sizes)} groups"
            )
        self.group_sizes: Sequence[int] = tuple(group_sizes)
        self.block_indices: Sequence[int] = tuple(block_indices)


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Chunk slots in the host pool, one per offload key, in key order."""

    @property
    def slots(self) -> np.ndarray:
        """The pool slots (the contract calls them block_ids)."""
        return self.block_ids


@dataclass
class CanonicalKVCacheTensor:
    """An engine KV cache tensor whose first dimension is num_blocks."""

    tensor: torch.Tensor
    page_size_bytes: int  # bytes per block, possibly padded


@dataclass(frozen=True)
class CopyRun:
    """A strided byte correspondence between this worker's page and the
    canonical page: fragment i covers [local_offset + i*local_stride, +size)
    locally and [canonical_offset + i*canonical_stride, +size) canonically."""

    local_offset: int
    canonical_offset: int
    fragment_size: int
    num_fragments: int
    local_stride: int
    canonical_stride: int


@dataclass(frozen=True)
class CanonicalPageMapping:
    """How this worker's page maps into a parallelism-free canonical page.
    Ranks that hold identical bytes take turns (by block) writing them."""

    canonical_page_size_bytes: int
    local_page_size_bytes: int
    runs: tuple[CopyRun, ...]
    num_writers: int
    writer_index: int
    parallelism_agnostic: bool

    def is_writer(self, block_id: int) -> bool:
        """Whether this worker writes the canonical page of this block."""
        return block_id % self.num_writers == self.writer_index


@dataclass
class CanonicalKVCacheRef:
    """One layer's (or layer group's) view into a CanonicalKVCacheTensor."""

    tensor_idx: int
    page_size_bytes: int  # un-padded bytes per block for this layer
    mapping: CanonicalPageMapping | None = None  # None: not certified canonical


@dataclass
class CanonicalKVCaches:
    """The engine's KV caches as unique block tensors plus, per KV group,
    the references of its layers into them."""

    tensors: list[CanonicalKVCacheTensor]
    group_data_refs: list[list[CanonicalKVCacheRef]]


@dataclass
class TransferResult:
    job_id: int
    success: bool
    transfer_size: int | None = None  # bytes
    transfer_time: float | None = None  # seconds


class OffloadingWorker(ABC):
    """Worker-side mover for one offloaded medium. Direction is explicit."""

    @abstractmethod
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Start copying GPU blocks to the medium; False if not accepted."""

    @abstractmethod
    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        """Start copying blocks from the medium into GPU blocks."""

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call."""

    @abstractmethod
    def wait(self, job_ids: set[int]) -> None:
        """Block until the given jobs have finished."""

    def shutdown(self) -> None:
        return
