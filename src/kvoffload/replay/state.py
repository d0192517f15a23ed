"""Per-request and per-job state of the simulated engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvoffload.abstractions import ReqContext
from kvoffload.replay.traces import Request


@dataclass
class Seen:
    """A request the scheduler has looked at (it may still be waiting)."""

    ctx: ReqContext
    keys: list[bytes]  # prompt keys, prefix order
    seeds: np.ndarray  # per prompt block: the seed of its contents (its hash as int64)
    request_level: bool  # the manager wants every block stored, hits too
    index: int = 0  # arrival order
    pending: set[bytes] = field(default_factory=set)  # keys that answered HIT_PENDING/RETRY
    # transfer jobs in flight (vLLM's transfer_jobs: a request with any is not looked up)
    jobs: set[int] = field(default_factory=set)
    offered: int = 0  # keys before this were offered to prepare_store (vLLM's next_stored_chunk_idx)
    # tiered specs: keys the CPU tier lacked at first sight, and the step, so a
    # hit on one of them that the engine did not store since was promoted
    absent: set[bytes] | None = None
    first_step: int = 0
    preempted: bool = False


@dataclass
class Running:
    """A scheduled request: its GPU slots and where it is in its life."""

    req: Request
    ctx: ReqContext
    keys: list[bytes]  # prompt keys, then decode keys
    hashes: list[int]  # block hashes (decode ones only when the GPU tracks hashes: gpu.track)
    slots: np.ndarray  # GPU slots (int64), one per key
    n_gpu: int
    n_off: int
    seeds: np.ndarray  # per block: the seed of its contents
    # legacy: load -> store -> done; vllm: loading -> loaded -> prefill -> decode -> done
    phase: str = "load"
    jobs: set[int] = field(default_factory=set)  # vllm order: the Seen's set
    request_level: bool = False
    bad: list[int] = field(default_factory=list)  # loaded block indices that failed
    stored: set[bytes] = field(default_factory=set)  # legacy order: keys this request stored
    promoted: set[int] = field(default_factory=set)  # loaded block indices a lower tier supplied
    seen: Seen | None = None
    computed: int = 0  # vllm order: leading keys whose KV is on the GPU
    filled: bool = False  # its computed blocks' contents are written (_compute)
    registered: int = 0  # leading slots registered in the GPU prefix cache
    left: int = 0  # vllm order: decode steps left
    aborted: bool = False
    first_step: int = 0  # the step it was scheduled
    resumed: bool = False  # rescheduled after a preemption


@dataclass(slots=True)
class Job:
    """A load or store handed (or about to be handed) to the worker."""

    run: Running
    is_load: bool
    keys: list[bytes]
    slots: np.ndarray  # GPU slots, one per key
    seeds: np.ndarray  # contents of those blocks (loads are checked against them)
    lo: int  # index of keys[0] in run.keys
    spec: Any  # the manager's LoadStoreSpec of the offloaded side
