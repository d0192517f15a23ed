"""The tiering manager's own jobs, and the one place their completions are
applied.

Two kinds, both between a host-pool (CPU) slot and a secondary tier:
  a cascade   (store)  CPU -> tier: the CPU copy is pinned (prepare_load)
                       and the tier's slot prepared (prepare_store) until it lands;
  a promotion (load)   tier -> CPU: the tier's copy is pinned (prepare_load)
                       and a CPU slot prepared (prepare_store) until it lands.
Completing one completes both sides.

Resets: TieringManager.reset_cache waits for every job in flight, so no job
touches a CPU slot after it, and applies what the workers report. A worker
may report a waited job only at a later get_finished(); by then the CPU tier
has forgotten the job's keys, so such a job (one of an earlier epoch) is
completed on the tier's side only (its manager keeps in-flight keys across
a reset).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvoffload.abstractions import OffloadingManager, OffloadKey, ReqContext
from kvoffload.tiering.tier import Tier


@dataclass(slots=True)
class Job:
    tier: int  # index of the secondary tier in the manager's tiers
    is_store: bool  # True: a cascade (CPU -> tier); False: a promotion (tier -> CPU)
    keys: list[OffloadKey]
    ctx: ReqContext
    epoch: int  # JobTable.epoch when submitted (resets since the start)


class JobTable:
    def __init__(self) -> None:
        self._jobs: dict[int, Job] = {}
        self._next_id = 1
        self.added = 0  # jobs submitted (a refused submit took an id but added none)
        self.epoch = 0

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __iter__(self) -> Iterator[Job]:
        return iter(list(self._jobs.values()))

    def new_id(self) -> int:
        job_id = self._next_id
        self._next_id += 1
        return job_id

    def add(self, job_id: int, tier: int, is_store: bool, keys: list[OffloadKey], ctx: ReqContext) -> None:
        self._jobs[job_id] = Job(tier, is_store, keys, ctx, self.epoch)
        self.added += 1

    def ids_of_tier(self, tier: int) -> set[int]:
        return {j for j, job in self._jobs.items() if job.tier == tier}

    def new_epoch(self) -> None:
        """A reset: jobs still here were waited for, their keys forgotten by the CPU tier."""
        self.epoch += 1

    def apply_finished(self, primary: OffloadingManager, tiers: list[Tier],
                       job_done: Callable[[Job, bool], None]) -> None:
        """Apply the jobs the tiers' workers finished: both sides' complete
        calls, the tier's counters, then job_done(job, success)."""
        for t in tiers:
            if t.worker is None:
                continue
            for res in t.worker.get_finished():
                job = self._jobs.pop(res.job_id, None)
                if job is None:
                    continue
                keys, ctx, ok = job.keys, job.ctx, res.success
                current = job.epoch == self.epoch  # else the CPU tier forgot its keys at a reset
                if job.is_store:
                    t.manager.complete_store(keys, ctx, success=ok)
                    if current:
                        primary.release(keys)  # unpin the CPU copies (no load: nothing was served)
                    t.in_flight -= len(keys)
                    if not ok:
                        t.count("failed_stores", len(keys))
                else:
                    t.manager.complete_load(keys, ctx)
                    if current:
                        primary.complete_store(keys, ctx, success=ok)
                    ok = ok and current
                    t.count("promoted_blocks" if ok else "promotion_failures", len(keys))
                job_done(job, ok)
