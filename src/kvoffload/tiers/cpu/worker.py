"""The CPU tier's worker: copies KV pages between the engine's KV cache
tensors and the host pool, asynchronously.

A thin front: it checks each job in the caller's thread (plan.py), hands
it to the executor for the tensors' device (copy_cpu.py: one transfer
thread; copy_cuda.py: own streams and events) and keeps the job table
(in flight, finished, who waits on what). The pool is the worker's own
HostPool, or one the TP ranks of a node share (`pool=`).
"""

from __future__ import annotations

import logging
import threading

import torch

from kvoffload.abstractions import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from kvoffload.config import OffloadingConfig
from kvoffload.layout import check_config_offloadable, check_shareable
from kvoffload.tiers.cpu.plan import LOAD, STORE, CopyPlanner, chunk_layout
from kvoffload.tiers.host_pool import HostPool, slot_bytes

__all__ = ["CPUOffloadingWorker", "chunk_layout", "STORE", "LOAD"]

logger = logging.getLogger(__name__)


class CPUOffloadingWorker(OffloadingWorker):
    """Moves chunks between the engine's KV caches and a HostPool."""

    def __init__(self, kv_caches: CanonicalKVCaches, config: OffloadingConfig, num_chunks: int,
                 pool: HostPool | None = None, trailer_bytes: int = 0):
        """`pool`: a HostPool shared with the other TP ranks of this node
        (every ref must then be parallelism-agnostic); None: one of our own,
        with trailer_bytes of room after each chunk (HostPool's)."""
        check_config_offloadable(config)
        self.kv_caches = kv_caches
        self.config = config
        self.layout, self.chunk_bytes = chunk_layout(kv_caches, config)
        for i, kvt in enumerate(kv_caches.tensors):
            t = kvt.tensor
            if t.element_size() != 1 or t.dim() < 2 or not t[0].is_contiguous():
                raise ValueError(
                    f"kv tensor {i} must be a 1-byte (num_blocks, page bytes) view with contiguous "
                    f"pages, got {t.dtype} {tuple(t.shape)} strides {t.stride()} "
                    "(kvoffload.kv_caches.make_kv_caches builds one)"
                )
        devices = {kvt.tensor.device for kvt in kv_caches.tensors}
        if len(devices) > 1:
            raise ValueError(f"kv tensors are on several devices: {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.use_cuda = self.device.type == "cuda"
        self.shared_pool = pool is not None
        if pool is not None:
            check_shareable(kv_caches)
            if pool.num_chunks < num_chunks or pool.chunk_bytes < self.chunk_bytes:
                raise ValueError(f"shared pool has {pool.num_chunks} chunks of {pool.chunk_bytes} B; "
                                 f"need {num_chunks} of {self.chunk_bytes} B")
        # the planner checks the refs before any memory is taken
        stride = pool.chunk_bytes if pool is not None else slot_bytes(self.chunk_bytes, trailer_bytes)
        self.planner = CopyPlanner(kv_caches, config, self.layout, num_chunks, stride,
                                   shared_pool=self.shared_pool, strided=not self.use_cuda)
        try:
            self.pool = pool if pool is not None else HostPool(num_chunks, self.chunk_bytes, trailer_bytes)
        except (OSError, ValueError, OverflowError) as e:
            raise ValueError(f"cannot allocate a host pool of {num_chunks} chunks x {self.chunk_bytes} "
                             f"bytes: {e}") from None
        self.num_chunks = num_chunks
        self.last_error: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._in_flight: set[int] = set()
        # per blocked wait(): the job ids it still waits for, and its event;
        # set once, when the last of them finishes (one wake-up per wait, not per job)
        self._waiters: list[tuple[set[int], threading.Event]] = []
        self._finished: list[TransferResult] = []
        if self.use_cuda:
            from kvoffload.tiers.cpu.copy_cuda import CUDACopier

            self.copier = CUDACopier(self.planner, kv_caches, self.pool, self._finish, self.device)
        else:
            from kvoffload.tiers.cpu.copy_cpu import CPUCopier

            self.copier = CPUCopier(self.planner, kv_caches, self.pool, self._finish)

    # ---- OffloadingWorker -------------------------------------------

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, STORE, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._submit(job_id, LOAD, dst_spec, src_spec)

    def _submit(self, job_id: int, direction: str, gpu, cpu) -> bool:
        try:
            groups = self.planner.check(gpu, cpu)
        except ValueError as e:
            return self._refuse(direction, f"job {job_id}: {e}")
        with self._lock:
            if self._closed:
                return self._refuse(direction, "worker is shut down")
            if job_id in self._in_flight:
                return self._refuse(direction, f"job {job_id} is already in flight")
            self._in_flight.add(job_id)
        self.copier.submit(job_id, direction, groups)
        return True

    def run_copies_inline(self) -> bool:
        """Copy each job in the thread that submits it, before the submit
        returns (CPU tensors only; copy_cpu.CPUCopier.run_inline). Jobs are
        still reported through get_finished. False (nothing changed) on a
        GPU, where the copies are asynchronous on streams anyway."""
        run_inline = getattr(self.copier, "run_inline", None)
        if run_inline is None:
            return False
        run_inline()
        return True

    def _refuse(self, direction: str, why: str) -> bool:
        self.last_error = why
        logger.warning("refused %s job: %s", direction, why)
        return False

    def get_finished(self) -> list[TransferResult]:
        self.copier.poll()
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        job_ids = set(job_ids)
        self.copier.poll(block_on=job_ids)
        with self._lock:
            remaining = job_ids & self._in_flight
            if not remaining:
                return
            waiter = (remaining, threading.Event())
            self._waiters.append(waiter)
        waiter[1].wait()

    def _finish(self, job_id: int, nbytes: int, seconds: float | None) -> None:
        """Report a job; nbytes < 0 means it failed."""
        with self._lock:
            self._in_flight.discard(job_id)
            self._finished.append(TransferResult(job_id, nbytes >= 0, max(nbytes, 0), seconds))
            for waiter in self._waiters:
                remaining, done = waiter
                if job_id in remaining:
                    remaining.discard(job_id)
                    if not remaining:
                        done.set()
            if self._waiters:
                self._waiters = [w for w in self._waiters if w[0]]

    def shutdown(self) -> None:
        """Finish the jobs already submitted, then stop and unpin the pool."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            in_flight = set(self._in_flight)
        self.copier.close(in_flight)
        if not self.shared_pool:
            self.pool.close()  # a shared pool is closed by whoever made it
