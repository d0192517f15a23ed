"""The CUDA executor of copy plans: KV tensors on a GPU, the pool pinned.

A thin loop over the same plan as the CPU executor (plan.py, every
fragment a piece, neighbours merged): per job, one asynchronous copy_ per
merged byte range, all on the worker's own stream for that direction
(store and load overlap), after the stream waited on an event recorded on
the compute stream (so blocks are read or overwritten only once the
compute work queued before the job is done; the compute stream itself
never waits on us). A job is done when the event recorded after its last
copy completes, found by polling (get_finished) or synchronizing on that
event alone (wait), never the device.

torch offers no batched host<->device memcpy (cudaMemcpyBatchAsync) nor a
way to read pinned host memory from a kernel without a custom op, so "one
copy per job" is reached only where ranges merge (consecutive blocks into
consecutive slots, the usual case when the manager hands out consecutive
free slots); `issue` takes the copy primitive as an argument so it can be
swapped (and is tested on CPU tensors). Untested on a GPU in this repo's
CI; benchmarks/gpu_check.py checks it on one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from kvoffload.abstractions import CanonicalKVCaches
from kvoffload.tiers.cpu.plan import LOAD, STORE, CopyPlanner, GroupJob, Plan
from kvoffload.tiers.host_pool import HostPool

logger = logging.getLogger(__name__)

Copy = Callable[[torch.Tensor, torch.Tensor], object]  # (dst, src) byte views


def copy_async(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


def byte_views(kv_caches: CanonicalKVCaches, pool: HostPool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """1-D int8 views over each KV tensor's blocks and over the pool: the
    plan's offsets index these."""
    flat = []
    for kvt in kv_caches.tensors:
        t = kvt.tensor
        span = (t.shape[0] - 1) * t.stride(0) + t[0].numel()
        flat.append(t.view(torch.int8).as_strided((span,), (1,), t.storage_offset()))
    return flat, pool.tensor.view(torch.int8).view(-1)


def issue(plan: Plan, flat: list[torch.Tensor], pool_flat: torch.Tensor, copy: Copy = copy_async) -> int:
    """Issue one copy per merged range of the plan; returns how many."""
    if plan.strided:
        raise ValueError("the CUDA executor copies pieces only; plan with strided=False")
    ranges = zip(plan.tensor_idx.tolist(), plan.gpu_offset.tolist(), plan.pool_offset.tolist(),
                 plan.size.tolist())
    n = 0
    if plan.direction == STORE:
        for t, g, p, size in ranges:
            copy(pool_flat.narrow(0, p, size), flat[t].narrow(0, g, size))
            n += 1
    else:
        for t, g, p, size in ranges:
            copy(flat[t].narrow(0, g, size), pool_flat.narrow(0, p, size))
            n += 1
    return n


class CUDACopier:
    """Launches plans on its own CUDA streams; reports each job through
    `finish` (job id, bytes or -1, seconds) when polled."""

    def __init__(self, planner: CopyPlanner, kv_caches: CanonicalKVCaches, pool: HostPool, finish,
                 device: torch.device):
        self.planner, self._finish, self.device = planner, finish, device
        if not pool.pinned:  # pageable memory: every copy would block the host
            logger.warning("host pool is not pinned (cudaHostRegister failed): CUDA copies will be slow")
        self._flat, self._pool_flat = byte_views(kv_caches, pool)
        self._streams = {STORE: torch.cuda.Stream(device), LOAD: torch.cuda.Stream(device)}
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Plan, torch.cuda.Event, torch.cuda.Event]] = {}  # submit order

    def submit(self, job_id: int, direction: str, groups: list[GroupJob]) -> None:
        stream = self._streams[direction]
        try:
            plan = self.planner.plan(job_id, direction, groups)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            stream.wait_event(ready)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                issue(plan, self._flat, self._pool_flat)
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
