"""The CPU tier: host DRAM as the first offloading tier below the GPU.

manager.py   scheduler-side slot bookkeeping (CPUOffloadingManager)
worker.py    worker-side copies GPU <-> host pool (CPUOffloadingWorker), a thin front over
plan.py      the copy planner: which byte ranges a job moves (pure numpy)
copy_cpu.py  its executor for KV tensors in host memory (one transfer thread; _memcopy.c: a job's
             ranges in one C call without the GIL, built at install; else a ctypes loop)
copy_cuda.py its executor for KV tensors on a GPU (own streams, events, pinned pool)
spec.py      both built from one OffloadingConfig (CPUOffloadingSpec, "cpu")
The host pool itself: kvoffload/tiers/host_pool.py.
"""

from kvoffload.tiers.cpu.manager import CPUOffloadingManager
from kvoffload.tiers.cpu.spec import CPUOffloadingSpec
from kvoffload.tiers.cpu.worker import CPUOffloadingWorker, chunk_layout

__all__ = ["CPUOffloadingManager", "CPUOffloadingSpec", "CPUOffloadingWorker", "chunk_layout"]
