"""The legacy call order of a replay: a request's stores complete before it
finishes, and its blocks are touched at scheduling and at finish (the trace
README's reference semantics; see engine.py).

A mixin of ReplayEngine (engine.py): it reads and writes the engine's state.
"""

from __future__ import annotations

from kvoffload.replay.state import Job, Running


class LegacyOrder:
    def _settle(self) -> int:
        """Legacy order: apply finished transfers and move requests on until
        nothing changes. Returns how many requests finished."""
        finished = 0
        while True:
            changed = self._poll()
            for run in list(self.running):
                if run.jobs:
                    continue
                if run.phase == "load":
                    self._compute(run)
                    plen = len(run.req.block_hashes)
                    first_new = run.n_gpu + run.n_off
                    lo = 0 if run.request_level else first_new
                    jobs: list[Job] = []
                    self._offer(run, lo, plen if self.prompt_only else len(run.keys), jobs)
                    for job in jobs:
                        self._submit(job)
                    run.phase = "store"
                    changed = True
                if run.phase == "store" and not run.jobs:
                    self._finish(run)
                    finished += 1
                    changed = True
            if not changed:
                return finished

    def _finish(self, run: Running) -> None:
        """Legacy order: the request's stores have landed."""
        plen = len(run.req.block_hashes)
        # The blocks this request reused are used once more after its new ones
        # were stored, so the request's blocks end up most recent head first.
        # Not the new ones: a touch right after the store would count as a
        # second use (and promote every block in a frequency-aware policy).
        new = run.stored
        self.mgr.touch([k for k in run.keys[:plen] if k not in new] if new else run.keys[:plen], run.ctx)
        self.mgr.on_request_finished(run.ctx)
        # Tail first, as vLLM frees them: the head stays cached longest.
        self.gpu.release(run.slots[::-1])
        self.running.remove(run)
        del self._seen[run.req.req_id]
        run.phase = "done"
