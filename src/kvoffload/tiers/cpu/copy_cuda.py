"""The CUDA executor of copy plans: KV tensors on a GPU, the pool pinned.

The same loop over the same plan as the CPU executor (plan.py, every
fragment a piece, neighbours merged), with cuMemcpyAsync (the driver's
copy, called through ctypes: ~0.5 us a range, where a torch copy_ of two
narrowed views costs ~10x that in Python and dispatch) in place of memmove:
raw addresses, the direction inferred from them (unified addressing), on
the worker's own stream for that direction (stores and loads overlap),
after that stream waited on an event recorded on the compute stream (so
blocks are read or overwritten only once the compute work queued before
the job is done; the compute stream never waits on us). A job is done when
the event recorded after its last copy completes, found by polling
(get_finished) or by synchronizing on that event alone (wait), never the
device.

torch exposes no batched host<->device memcpy (cudaMemcpyBatchAsync), so
a job is one copy per merged range: one per job where blocks and slots run
consecutively (one layer, or layers adjacent in one tensor), else one per
block and layer. `issue` takes the copy primitive as an argument: tests
run it on CPU tensors with memmove. Not run on a GPU in this repo's CI:
benchmarks/gpu_check.py checks it on one.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable

import numpy as np
import torch

from kvoffload.abstractions import CanonicalKVCaches
from kvoffload.tiers.cpu.plan import LOAD, STORE, CopyPlanner, GroupJob, Plan, base_addresses
from kvoffload.tiers.host_pool import HostPool

logger = logging.getLogger(__name__)

Copy = Callable[[int, int, int], int]  # (dst address, src address, bytes) -> 0 when issued


def issue(plan: Plan, gpu_base: np.ndarray, pool_base: int, copy: Copy) -> int:
    """Issue one copy per merged range of the plan; returns how many."""
    if plan.strided:
        raise ValueError("the CUDA executor copies pieces only; plan with strided=False")
    for dst, src, n in plan.ranges(gpu_base, pool_base):
        if status := copy(dst, src, n):
            raise RuntimeError(f"cuMemcpyAsync of {n} bytes failed: CUresult {status}")
    return len(plan.size)


def driver_copy(stream: torch.cuda.Stream) -> Copy:
    """cuMemcpyAsync on `stream`, from libcuda (the driver torch itself uses)."""
    fn = ctypes.CDLL("libcuda.so.1").cuMemcpyAsync
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    handle = stream.cuda_stream
    return lambda dst, src, n: fn(dst, src, n, handle)


class CUDACopier:
    """Launches plans on its own CUDA streams; reports each job through
    `finish` (job id, bytes or -1, seconds) when polled."""

    def __init__(self, planner: CopyPlanner, kv_caches: CanonicalKVCaches, pool: HostPool, finish,
                 device: torch.device):
        self.planner, self._finish, self.device = planner, finish, device
        if not pool.pinned:  # pageable memory: every copy would block the host
            logger.warning("host pool is not pinned (cudaHostRegister failed): CUDA copies will be slow")
        self._gpu_base, self._pool_base = base_addresses(kv_caches, pool)
        self._streams = {STORE: torch.cuda.Stream(device), LOAD: torch.cuda.Stream(device)}
        self._copy = {d: driver_copy(s) for d, s in self._streams.items()}
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Plan, torch.cuda.Event, torch.cuda.Event]] = {}  # submit order

    def submit(self, job_id: int, direction: str, groups: list[GroupJob]) -> None:
        stream = self._streams[direction]
        try:
            plan = self.planner.plan(job_id, direction, groups)
            with torch.cuda.device(self.device):  # its context current on this thread for the driver calls
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))
                stream.wait_event(ready)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                issue(plan, self._gpu_base, self._pool_base, self._copy[direction])
                end.record(stream)
        except Exception:
            logger.exception("CUDA offload %s job %d failed to launch", direction, job_id)
            self._finish(job_id, -1, None)
            return
        with self._lock:
            self._pending[job_id] = (plan, start, end)

    def poll(self, block_on: set[int] | None = None) -> None:
        """Report finished jobs; first wait for the events of block_on's."""
        with self._lock:
            pending = list(self._pending.values())
        for plan, start, end in pending:
            if block_on and plan.job_id in block_on:
                end.synchronize()
            elif not end.query():
                continue
            with self._lock:
                if self._pending.pop(plan.job_id, None) is None:
                    continue  # another thread reported it
            self._finish(plan.job_id, plan.nbytes, start.elapsed_time(end) / 1000.0)

    def close(self, in_flight: set[int]) -> None:
        self.poll(block_on=set(in_flight))
