"""One engine step in the order of vLLM 0.32/0.33's Scheduler and
OffloadingConnector (the replay's default call order).

Per step: lookups and prepare_load for waiting requests (schedule),
on_schedule_end, prepare_store for the blocks computed this step and the
final ones of requests that finished last step, then on_request_finished for
those (build_connector_meta); then the model step; then complete_load/
complete_store for the jobs submitted the step before
(update_connector_output: every job lands exactly one step after its
submission, so a run does not depend on thread timing). No touch (vLLM never
calls it): managers record recency themselves. A request finishes while its
stores are in flight; its GPU blocks are freed at once and fenced: a store
still reading a block is waited for before the block is written again.

Options: preempt_every (the newest decoding request loses its GPU blocks and
waits again; its stores are flushed), abort_every (every N-th request is
aborted the step it is scheduled, loads in flight included), reset_every
(vLLM's reset_cache: finished requests signalled, manager.reset_cache(), jobs
in flight flushed and their completions dropped, running requests store
again from their first block, then on_reset_flushed if the manager has it).

A mixin of ReplayEngine (engine.py): it reads and writes the engine's state.
"""

from __future__ import annotations

from collections import deque

from kvoffload.abstractions import ScheduleEndContext
from kvoffload.replay.state import Job, Running


class VllmOrder:
    def _vllm_step(self, waiting: deque) -> int:
        """One engine step in vLLM's order; returns how many requests finished."""
        opts, c, mgr = self.opts, self.c, self.mgr
        step = int(c["steps"])
        if opts.reset_every and step % opts.reset_every == 0:
            self._reset()  # between steps, as reset_prefix_cache runs
        # Scheduler.schedule(): running requests first (one may be preempted),
        # then requests whose loads landed, then the waiting queue
        preempted: list[str] = []
        if opts.preempt_every and step % opts.preempt_every == 0:
            # once per request at most: a long decode preempted every N steps would never finish
            victim = next((r for r in reversed(self.running) if r.phase == "decode" and not r.resumed), None)
            if victim is not None:
                self._preempt(victim, waiting)
                preempted.append(victim.req.req_id)
        for run in self.running:
            if run.phase == "loaded":
                run.phase = "prefill"
        self._schedule(waiting)
        new_ids = [r.req.req_id for r in self.running if r.phase == "prefill" and not r.resumed]
        # build_connector_meta(): on_schedule_end, stores of what this step
        # computes and of the requests that finished last step, then their
        # on_request_finished
        mgr.on_schedule_end(ScheduleEndContext(new_ids, preempted))
        loads, self._to_submit = self._to_submit, []
        stores: list[Job] = []
        computing: list[Running] = []
        budget = opts.max_batched_tokens // self.trace.block_size if opts.max_batched_tokens else None
        for run in self.running:
            if run.phase == "prefill":
                if budget is not None and budget <= 0 and run.computed < len(run.req.block_hashes):
                    continue  # the step's tokens are spent: next step
                budget = self._prefill_chunk(run, budget)
            elif run.phase == "decode":
                run.computed += 1
            else:
                continue
            computing.append(run)
            self._offer_vllm(run, run.computed, stores)
        flush: list[Job] = []
        finishing, self.finishing = self.finishing, []
        for run in finishing:
            if not run.aborted:
                self._offer_vllm(run, len(run.keys), flush)
        for run in finishing:  # after every prepare_store of the step
            mgr.on_request_finished(run.ctx)
            self._seen.pop(run.req.req_id, None)
        if opts.events is not None:
            opts.events.publish(self.manager.take_events())
        # the worker: a finished request's last stores read GPU blocks that may
        # be re-allocated this step, so they are flushed (run and waited for)
        # before anything writes blocks: then loads, the forward pass, stores
        if flush:
            ids = {j for j in map(self._submit, flush) if j is not None}
            if ids:
                self.c["fence_waits"] += 1
                self.wrk.wait(ids)
        for job in loads:
            self._submit(job)
        for run in computing:
            if run.phase == "prefill":
                done = run.computed >= len(run.req.block_hashes)
                self._compute(run, None if done else run.computed)
        for job in stores:
            self._submit(job)
        # update_from_output(): requests move on or finish, then the jobs
        # submitted in earlier steps complete
        finished = 0
        every = opts.abort_every
        for run in list(self.running):
            if every and run.first_step == step and not run.resumed and run.seen.index % every == every - 1:
                self._abort(run)
                finished += 1
                continue
            if run.phase == "prefill":
                if run.computed < len(run.req.block_hashes):
                    continue  # chunked: more of the prompt next step
                run.phase = "decode"
                run.left = len(run.keys) - len(run.req.block_hashes)
                self._step_decode += run.req.output_tokens  # the engine time's decode charge
            elif run.phase == "decode":
                run.left -= 1
            else:
                continue
            if run.left <= 0:
                self._release(run)
                run.phase = "done"
                self.finishing.append(run)
                finished += 1
        self._step_busy = bool(computing or finished)
        progressed = self._poll()
        if not computing and not finished and not progressed:
            self._idle_wait()
            self._poll()
        for run in [r for r in self._zombies if not r.jobs]:
            self._zombies.remove(run)
            self.gpu.release(run.slots[::-1])
        return finished

    def _prefill_chunk(self, run: Running, budget: int | None) -> int | None:
        """Compute the next chunk of a prefilling request's prompt: as many
        blocks as the step's budget has left (None: all). Returns the
        budget left."""
        req, plen = run.req, len(run.req.block_hashes)
        start = max(run.computed, run.n_gpu + run.n_off)
        end = plen if budget is None else min(plen, start + budget)
        run.computed = end
        # the simulated clock: the chunk's tokens (the last chunk takes the prompt's tail)
        self._step_tokens += (req.prompt_tokens - self.tokens_in(req, 0, start) if end == plen
                              else self.tokens_in(req, start, end))
        return None if budget is None else budget - (end - start)

    def _offer_vllm(self, run: Running, computed: int, jobs: list[Job]) -> None:
        """prepare_store of the computed keys not offered yet (vLLM's
        _build_store_jobs); a refused store is offered again next step."""
        seen = run.seen
        end = min(computed, len(run.req.block_hashes) if self.prompt_only else len(run.keys))
        if end > seen.offered and self._offer(run, seen.offered, end, jobs):
            seen.offered = end

    def _release(self, run: Running) -> None:
        """Free a request's GPU blocks, tail first as vLLM frees them (the
        head stays cached longest), fencing those its stores still read."""
        fence = self._fence
        for job_id in run.jobs:
            job = self._jobs.get(job_id)
            if job is not None and not job.is_load:
                fence[job.slots] = job_id
        self.running.remove(run)
        self.gpu.release(run.slots[::-1])

    def _preempt(self, run: Running, waiting: deque) -> None:
        """The request loses its GPU blocks and waits again at the head of the
        queue; vLLM flushes its stores before the blocks are reused."""
        self.c["preemptions"] += 1
        if run.jobs:
            self.wrk.wait(set(run.jobs))
        self.running.remove(run)
        self.gpu.release(run.slots[::-1])
        run.phase = "done"
        run.seen.preempted = True
        waiting.appendleft((run.req, 0))

    def _abort(self, run: Running) -> None:
        """Aborted: finished (on_request_finished next step) with nothing more
        to store; a load in flight keeps its GPU blocks until it lands."""
        self.c["aborts"] += 1
        run.aborted = True
        if run.phase == "loading" and run.jobs:
            self.running.remove(run)
            self._zombies.append(run)
        else:
            self._release(run)
        run.phase = "done"
        self.finishing.append(run)

    def _reset(self) -> None:
        """vLLM's OffloadingConnectorScheduler.reset_cache: finished requests
        are signalled, the manager resets, every job in flight becomes stale
        (the workers flush it; its completion never reaches the manager), and
        running requests store again from their first block."""
        mgr = self.mgr
        self.c["resets"] += 1
        for run in self.finishing:
            mgr.on_request_finished(run.ctx)
            self._seen.pop(run.req.req_id, None)
        self.finishing = []
        mgr.reset_cache()
        self._stale.update(self._jobs)
        for seen in self._seen.values():
            seen.offered = 0
            seen.jobs.clear()
        for run in self._zombies:
            run.jobs.clear()
        if self._jobs:
            self.wrk.wait(set(self._jobs))
            while self._jobs.keys() & self._stale:
                self._poll()
        if getattr(self.manager, "on_reset_flushed", None) is not None:  # the contract's hook: the flush is done
            mgr.on_reset_flushed()
