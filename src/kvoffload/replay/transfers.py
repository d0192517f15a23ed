"""The job table of a replay: stores offered to the manager, jobs handed to
the worker, and their completions applied (loads checked byte for byte,
then complete_load / complete_store).

A mixin of ReplayEngine (engine.py): it reads and writes the engine's state.
"""

from __future__ import annotations

import sys

import numpy as np

from kvoffload.abstractions import GPULoadStoreSpec
from kvoffload.replay.state import Job, Running


class VerificationError(RuntimeError):
    """A loaded block's bytes differ from what was stored."""


class Transfers:
    def _offer(self, run: Running, lo: int, end: int, jobs: list[Job]) -> bool:
        """prepare_store of run.keys[lo:end]; the store job for the keys the
        manager takes is appended to `jobs` for _submit. False if refused."""
        offer = run.keys[lo:end]
        if not offer:
            return True
        out = self.mgr.prepare_store(offer, run.ctx)
        c = self.c
        c["stored_blocks_offered"] += len(offer)
        if out is None:
            c["allocation_failures"] += 1
            return False
        c["evicted_blocks"] += len(out.evicted_keys)
        if not out.keys_to_store:
            return True
        store = list(out.keys_to_store)
        if self.opts.order == "legacy":
            run.stored.update(store)
        if store == offer:
            where = slice(lo, end)  # all of them, in order (the usual case)
        else:
            pos = {k: i for i, k in enumerate(offer, lo)}
            where = np.array([pos[k] for k in store], dtype=np.int64)
        jobs.append(Job(run, False, store, run.slots[where], run.seeds[where], 0, out.store_spec))
        return True

    def _submit(self, job: Job) -> int | None:
        """Hand a prepared load or store to the worker; a refused job is
        completed as failed at once. Returns the job id, None if refused."""
        run, keys = job.run, job.keys
        job_id = self._next_job()
        self._jobs[job_id] = job
        self._job_step[job_id] = int(self.c["steps"])
        if job.is_load:
            ok = self.wrk.submit_load(job_id, job.spec, GPULoadStoreSpec(job.slots))
        else:
            ok = self.wrk.submit_store(job_id, GPULoadStoreSpec(job.slots), job.spec)
        c = self.c
        c["load_jobs" if job.is_load else "store_jobs"] += 1
        if ok:
            run.jobs.add(job_id)
            return job_id
        del self._jobs[job_id]
        self._job_step.pop(job_id, None)
        if job.is_load:  # unpin and recompute those blocks
            c["load_failures"] += len(keys)
            run.bad.extend(range(job.lo, job.lo + len(keys)))
            if run.phase == "loading" and not run.jobs:
                run.phase = "loaded"
            self.mgr.complete_load(keys, run.ctx)
        else:
            c["store_failures"] += len(keys)
            self.mgr.complete_store(keys, run.ctx, success=False)
        return None

    def _poll(self) -> bool:
        """Apply the worker's finished jobs; True if there were any."""
        vllm = self.opts.order == "vllm"
        if vllm:
            # Every job submitted before this step completes in this step,
            # never later: the run does not depend on the copy thread's speed.
            step = self.c["steps"]
            due = {j for j, s in self._job_step.items() if s < step}
            if due:
                self.wrk.wait(due)
        results = self.wrk.get_finished()
        if vllm:  # completions reach the manager in a later step than their submission
            held, self._held = self._held, []
            self._held = [r for r in results if self._job_step.get(r.job_id) == step]
            results = held + [r for r in results if self._job_step.get(r.job_id) != step]
        for res in results:
            job = self._jobs.pop(res.job_id, None)
            if job is None:
                raise RuntimeError(f"worker reported unknown job {res.job_id}")
            self._job_step.pop(res.job_id, None)
            stale = res.job_id in self._stale
            if stale:
                self._stale.discard(res.job_id)
                self.c["stale_completions"] += 1
            run, keys = job.run, job.keys
            run.jobs.discard(res.job_id)
            c = self.c
            if self.opts.metrics is not None:
                self.opts.metrics.observe_transfer("cpu", "load" if job.is_load else "store",
                                                   res.transfer_size, res.transfer_time, "CPU", "LOCAL")
            if job.is_load:
                if res.success:
                    self._check_load(job)
                    c["bytes_loaded"] += res.transfer_size if res.transfer_size is not None \
                        else len(job.slots) * self.page_bytes
                    c["load_time_s"] += res.transfer_time or 0.0
                else:
                    c["load_failures"] += len(keys)
                    run.bad.extend(range(job.lo, job.lo + len(keys)))
                if run.phase == "loading" and not run.jobs:
                    run.phase = "loaded"
                if not stale:  # after a reset vLLM drops the completions of jobs in flight
                    self.mgr.complete_load(keys, run.ctx)
            else:
                if res.success:
                    c["bytes_stored"] += res.transfer_size if res.transfer_size is not None \
                        else len(job.slots) * self.page_bytes
                    c["store_time_s"] += res.transfer_time or 0.0
                else:
                    c["store_failures"] += len(keys)
                if not stale:
                    self.mgr.complete_store(keys, run.ctx, success=res.success)
                    if res.success and self._primary is not None:
                        step_now = int(c["steps"])
                        cpu_stored = self._cpu_stored
                        for k in keys:
                            cpu_stored[k] = step_now
        return bool(results)

    def _check_load(self, job: Job) -> None:
        """Compare a landed load's bytes with what they must be; blocks that
        differ are counted, reported and recomputed (or raise, strict)."""
        c, slots = self.c, job.slots
        with self._content:
            bad = self.contents.check(slots, job.seeds)
        c["verified_blocks"] += len(slots) - len(bad)
        if not len(bad):
            return
        c["verify_failures"] += len(bad)
        msg = (f"VERIFY FAILED: request {job.run.req.req_id}: {len(bad)} of {len(slots)} "
               f"loaded blocks differ from what was stored (first key "
               f"{job.keys[int(bad[0])].hex()}, GPU slot {int(slots[bad[0]])})")
        if self.opts.strict:
            raise VerificationError(msg)
        print(msg, file=sys.stderr)
        job.run.bad.extend(job.lo + int(i) for i in bad)
