"""Worker base of the remote key-value tiers: moves whole host-pool chunks
to and from a server on io_threads background threads; the subclass
(tiers/redis/worker.py, tiers/mooncake/worker.py) does the moving.

A load is what a request waits for, a store is background: queued loads
go before queued stores, and a load of 2 MiB or more is split into up to
io_threads parts (contiguous runs of its chunks) that the threads move at
once; the job is reported when its last part is done (failed if any part
failed). Stores stay whole, one per thread.

A job never raises: a part that fails (or raises) fails its job, and the
tiering manager turns that into a miss or a dropped store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from kvoffload.abstractions import CPULoadStoreSpec, TransferResult
from kvoffload.tiers.base import TierWorker, even_runs
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.remote.config import RemoteConfig
from kvoffload.tiers.remote.job import TransferJob
from kvoffload.tiers.remote.state import SharedState
from kvoffload.tiers.remote.value import RemoteLoadStoreSpec, ValueCodec

# A load is split only into parts of at least this many bytes: a smaller load
# waits on round trips, not bytes, and one connection serves it as well.
MIN_PART_BYTES = 1 << 20

log = logging.getLogger(__name__)


class RemoteTierWorker(TierWorker):
    """Queues, parts and completions of a remote tier; a subclass moves one
    part's bytes in _transfer (and may report it later, overriding _move)."""

    def __init__(self, pool: HostPool, client, cfg: RemoteConfig, state: SharedState,
                 codec: ValueCodec | None = None):
        self.pool = pool
        self._codec = codec or ValueCodec()
        self.payload_bytes = pool.used_chunk_bytes  # bytes of a chunk that carry data
        self._client = client
        self._cfg = cfg
        self._state = state
        self._queue = threading.Condition()  # guards _loads, _stores, _stopping
        self._loads: deque = deque()
        self._stores: deque = deque()
        self._stopping = False
        self._cond = threading.Condition()
        self._finished: list[TransferResult] = []
        self._in_flight: set[int] = set()
        self._queued_store_bytes = 0
        self._threads = [threading.Thread(target=self._run, name=f"kvoffload-remote-io{i}", daemon=True)
                         for i in range(cfg.io_threads)]
        for t in self._threads:
            t.start()

    # -- TierWorker -----------------------------------------------------
    def submit_store(self, job_id: int, src: CPULoadStoreSpec, dst: RemoteLoadStoreSpec) -> bool:
        slots = self._check(src, dst)
        nbytes = len(slots) * self.payload_bytes
        with self._cond:
            # back-pressure: a slow server drops stores instead of stalling the engine
            if self._queued_store_bytes + nbytes > self._cfg.max_queue_bytes:
                self._state.counters.add("store_queue_full")
                return False
            self._queued_store_bytes += nbytes
            self._in_flight.add(job_id)
            self._state.worker_queue_blocks += len(slots)
        self._enqueue(self._stores, [(TransferJob(job_id, True, len(slots), 1), slots, dst)])
        return True

    def submit_load(self, job_id: int, src: RemoteLoadStoreSpec, dst: CPULoadStoreSpec) -> bool:
        slots = self._check(dst, src)
        bounds = self._parts(len(slots))
        job = TransferJob(job_id, False, len(slots), len(bounds))
        if len(bounds) == 1:
            parts = [(job, slots, src)]
        else:
            parts = [(job, slots[a:b], RemoteLoadStoreSpec(src.redis_keys[a:b], src.keys[a:b])) for a, b in bounds]
        with self._cond:
            self._in_flight.add(job_id)
            self._state.worker_queue_blocks += len(slots)
        self._enqueue(self._loads, parts)
        return True

    def _parts(self, n: int) -> list[tuple[int, int]]:
        """[a, b) runs of a load's n chunks, one per thread that can move at
        least MIN_PART_BYTES of it."""
        k = max(1, min(len(self._threads), n * self.payload_bytes // MIN_PART_BYTES, n))
        return even_runs(n, k)

    def _enqueue(self, q: deque, items: list) -> None:
        with self._queue:
            q.extend(items)
            self._queue.notify(len(items))

    def _take(self):
        """The next part to move, loads first; None once shut down and drained."""
        with self._queue:
            while not (self._loads or self._stores or self._stopping):
                self._queue.wait()
            if self._loads:
                return self._loads.popleft()
            if self._stores:
                return self._stores.popleft()
            return None

    def get_finished(self) -> list[TransferResult]:
        with self._cond:
            done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        with self._cond:
            while self._in_flight & set(job_ids):
                self._cond.wait()

    def shutdown(self) -> None:
        with self._queue:  # the threads finish what is queued, then end
            self._stopping = True
            self._queue.notify_all()
        for t in self._threads:
            t.join(timeout=10)

    def _check(self, cpu: CPULoadStoreSpec, remote: RemoteLoadStoreSpec) -> list[int]:
        slots = cpu.block_ids.tolist()
        if len(slots) != len(remote.redis_keys):
            raise ValueError(f"remote job: {len(slots)} host slots for {len(remote.redis_keys)} keys")
        return slots

    # -- IO threads -----------------------------------------------------
    def _run(self) -> None:
        conns: dict = {}
        while (part := self._take()) is not None:
            self._move(conns, *part)
        for rc in conns.values():
            rc.close()

    def _move(self, conns: dict, job: TransferJob, slots: list[int], spec) -> None:
        """Move one part and report it (a subclass may report it later, from another thread)."""
        ok = False
        try:
            ok = self._transfer(conns, job.is_store, slots, spec)
        except Exception:  # noqa: BLE001 - a bug here must fail the job, not kill the thread
            log.exception("remote %s job %d failed", "store" if job.is_store else "load", job.job_id)
            self._state.counters.add("store_failures" if job.is_store else "load_failures", len(slots))
        self._part_done(job, len(slots), ok)

    def _part_done(self, job: TransferJob, n_slots: int, ok: bool) -> None:
        with self._cond:
            self._state.worker_queue_blocks -= n_slots
            job.ok = job.ok and ok
            job.parts_left -= 1
            if job.parts_left:
                return
            nbytes = job.blocks * self.payload_bytes
            if job.is_store:
                self._queued_store_bytes -= nbytes
            self._in_flight.discard(job.job_id)
            self._finished.append(TransferResult(job.job_id, job.ok, nbytes if job.ok else 0,
                                                 time.perf_counter() - job.start))
            self._cond.notify_all()

    def _transfer(self, conns: dict, is_store: bool, slots: list[int], spec: RemoteLoadStoreSpec) -> bool:
        """Move one part; False (never an exception) on failure."""
        raise NotImplementedError
