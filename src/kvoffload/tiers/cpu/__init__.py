"""The CPU tier: host DRAM as the first offloading tier below the GPU.

manager.py  scheduler-side slot bookkeeping (CPUOffloadingManager)
worker.py   worker-side copies GPU <-> host pool (CPUOffloadingWorker)
spec.py     both built from one OffloadingConfig (CPUOffloadingSpec, "cpu")
"""

from kvoffload.tiers.cpu.manager import CPUOffloadingManager
from kvoffload.tiers.cpu.spec import CPUOffloadingSpec
from kvoffload.tiers.cpu.worker import CPUOffloadingWorker, chunk_layout

__all__ = ["CPUOffloadingManager", "CPUOffloadingSpec", "CPUOffloadingWorker", "chunk_layout"]
