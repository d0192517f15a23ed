"""Blocking, thread-safe calls on one kvoffload secondary tier, for an
engine (SGLang's HiCache) that asks from its own background threads and
waits for the answer.

Everything goes through the tier's public manager/worker pair, so the
tier's own I/O, header and checksum checks, MAC, back-off and counters
apply unchanged: a corrupt, foreign or forged value fails its load job and
is a miss here. The manager is made for one scheduler thread, so its calls
are serialized under a lock; jobs run on the tier's own I/O threads.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

from kvoffload.abstractions import CPULoadStoreSpec, LookupResult, ReqContext, TransferResult
from kvoffload.tiers.base import SecondaryTier
from kvoffload.tiers.host_pool import HostPool

_RETRY_SLEEP_S = 0.001  # between re-asks of a RETRY (remote existence check in flight)
_MAX_LOOKUP_S = 30.0  # a manager that never settles a RETRY is a bug; never hang the engine on it


class TierIO:
    def __init__(self, tier: SecondaryTier, staging: HostPool):
        self.tier = tier
        self.manager = tier.get_manager()
        self.worker = tier.get_worker(staging)
        self._ctx = ReqContext(req_id="sglang-hicache")
        self.manager.on_new_request(self._ctx)
        self._lock = threading.Lock()  # manager calls
        self._results_lock = threading.Lock()
        self._results: dict[int, TransferResult] = {}
        self._job_ids = itertools.count(1)

    # -- lookups --------------------------------------------------------
    def present_prefix(self, keys: list[bytes]) -> int:
        """How many of keys, from the first, the tier holds readable now.

        Each pass asks every key not yet settled, so a remote tier queues one
        background existence check for the whole batch (not one per key);
        passes repeat while a key in the prefix is RETRY. The manager turns a
        check unanswered for lookup_deadline_s into MISS."""
        done, limit = 0, len(keys)  # keys[:done] are HIT; none past limit can count
        deadline = time.monotonic() + _MAX_LOOKUP_S
        while True:
            pending = False
            with self._lock:
                for j in range(done, limit):
                    answer = self.manager.lookup(keys[j], self._ctx)
                    if answer is LookupResult.HIT:
                        if not pending:
                            done = j + 1
                    elif answer is LookupResult.RETRY:
                        pending = True
                    else:  # MISS, or HIT_PENDING (still being written): the prefix ends here
                        limit = j
                        break
            if not pending or done >= limit or time.monotonic() > deadline:
                return done
            time.sleep(_RETRY_SLEEP_S)

    # -- transfers ------------------------------------------------------
    # start_* submits a job to the tier's worker and returns at once, so the
    # caller can copy the next pages while the tier moves these; finish()
    # waits for it and settles the manager. Every started job must be finished.
    def start_store(self, keys: list[bytes], slots: list[int]) -> Job:
        """Begin writing staging slots under keys (already-held keys are skipped)."""
        with self._lock:
            out = self.manager.prepare_store(keys, self._ctx)
        if out is None:  # no room, or a remote tier backing off
            return Job(keys, None, store=True, prepared=False)
        if not out.keys_to_store:
            return Job(keys, None, store=True, prepared=True, ok=True)
        where = dict(zip(keys, slots))
        src = CPULoadStoreSpec([where[k] for k in out.keys_to_store])
        return Job(keys, self._submit(lambda jid: self.worker.submit_store(jid, src, out.store_spec)), store=True)

    def start_load(self, keys: list[bytes], slots: list[int]) -> Job:
        """Begin reading keys into staging slots."""
        with self._lock:
            try:
                spec = self.manager.prepare_load(keys, self._ctx)
            except KeyError:  # the storage tier does not hold one of them (nothing pinned)
                return Job(keys, None, store=False, prepared=False)
        dst = CPULoadStoreSpec(slots)
        return Job(keys, self._submit(lambda jid: self.worker.submit_load(jid, spec, dst)), store=False)

    def finish(self, job: Job) -> bool:
        """Wait for a started job; True if every key of it moved (a load that
        fails says not which key: a miss, a corrupt value, a server down)."""
        ok = job.ok if job.job_id is None else self._wait(job.job_id)
        if job.prepared:
            with self._lock:
                if job.store:
                    self.manager.complete_store(job.keys, self._ctx, success=ok)
                else:
                    self.manager.complete_load(job.keys, self._ctx)
        return ok

    def store(self, keys: list[bytes], slots: list[int]) -> bool:
        return self.finish(self.start_store(keys, slots))

    def load(self, keys: list[bytes], slots: list[int]) -> bool:
        return self.finish(self.start_load(keys, slots))

    def _submit(self, submit) -> int | None:
        job_id = next(self._job_ids)
        return job_id if submit(job_id) else None

    def _wait(self, job_id: int) -> bool:
        self.worker.wait({job_id})
        # another thread may have collected our result with its own
        with self._results_lock:
            for r in self.worker.get_finished():
                self._results[r.job_id] = r
            result = self._results.pop(job_id, None)
        return bool(result is not None and result.success)

    def reset(self) -> None:
        with self._lock:
            self.manager.reset_cache()

    def close(self) -> None:
        with self._lock:
            self.manager.on_request_finished(self._ctx)
        # as the tiering manager does: the worker drains first, then the manager closes the medium
        self.worker.shutdown()
        self.manager.shutdown()


@dataclass
class Job:
    keys: list[bytes]
    job_id: int | None  # None: nothing submitted (refused, or nothing to write)
    store: bool
    prepared: bool = True  # the manager holds state for it until finish()
    ok: bool = False  # the result when nothing was submitted
