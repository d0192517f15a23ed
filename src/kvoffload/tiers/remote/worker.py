"""Worker of the remote tier: moves whole host-pool chunks to and from the
server on io_threads background threads, each with its own connection
(one per cluster node in cluster mode).

A load is what a request waits for, a store is background: queued loads
go before queued stores, and a load of 2 MiB or more is split into up to
io_threads parts (contiguous runs of its chunks) that the threads move at
once, each on its own connection; the job is reported when its last part
is done (failed if any part failed). Stores stay whole, one per thread.

A job never raises and never waits longer than the socket timeouts: on a
network error it fails (the tiering manager turns that into a miss or a
dropped store), the connection is closed, and the shared back-off keeps
everyone off the network until it is time to try reconnecting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import redis

from kvoffload.abstractions import CPULoadStoreSpec, TransferResult
from kvoffload.tiers.base import TierWorker, even_runs
from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.remote import resp
from kvoffload.tiers.remote.config import RemoteConfig
from kvoffload.tiers.remote.connection import NETWORK_ERRORS
from kvoffload.tiers.remote.resp import RawConnection
from kvoffload.tiers.remote.state import SharedState
from kvoffload.tiers.remote.value import RemoteLoadStoreSpec, ValueCodec

# A load is split only into parts of at least this many bytes: a smaller load
# waits on round trips, not bytes, and one connection serves it as well.
MIN_PART_BYTES = 1 << 20

# Values that must go: a later store rewrites the key (SET replaces any type).
_DELETE = {resp.CORRUPT: "checksum_failures", resp.WRONG_KEY: "wrong_key_values",
           resp.BAD_MAC: "mac_failures", resp.WRONG_TYPE: "wrong_type_keys"}

log = logging.getLogger(__name__)


class _Job:
    """One submitted job, over its parts."""

    __slots__ = ("job_id", "is_store", "blocks", "parts_left", "ok", "start")

    def __init__(self, job_id: int, is_store: bool, blocks: int, parts: int):
        self.job_id = job_id
        self.is_store = is_store
        self.blocks = blocks
        self.parts_left = parts
        self.ok = True
        self.start = time.perf_counter()


class RemoteTierWorker(TierWorker):
    def __init__(self, pool: HostPool, client, cfg: RemoteConfig, state: SharedState,
                 codec: ValueCodec | None = None):
        self.pool = pool
        self._codec = codec or ValueCodec()
        self.payload_bytes = pool.used_chunk_bytes  # bytes of a chunk that carry data
        self._client = client
        self._cluster = cfg.cluster
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
        self._topology_lock = threading.Lock()
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
        self._enqueue(self._stores, [(_Job(job_id, True, len(slots), 1), slots, dst)])
        return True

    def submit_load(self, job_id: int, src: RemoteLoadStoreSpec, dst: CPULoadStoreSpec) -> bool:
        slots = self._check(dst, src)
        bounds = self._parts(len(slots))
        job = _Job(job_id, False, len(slots), len(bounds))
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
        conns: dict[str, RawConnection] = {}
        while (part := self._take()) is not None:
            self._move(conns, *part)
        for rc in conns.values():
            rc.close()

    def _move(self, conns: dict, job: _Job, slots: list[int], spec) -> None:
        """Move one part and report it (a subclass may report it later, from another thread)."""
        ok = False
        try:
            ok = self._transfer(conns, job.is_store, slots, spec)
        except Exception:  # noqa: BLE001 - a bug here must fail the job, not kill the thread
            log.exception("remote %s job %d failed", "store" if job.is_store else "load", job.job_id)
            self._state.counters.add("store_failures" if job.is_store else "load_failures", len(slots))
        self._part_done(job, len(slots), ok)

    def _part_done(self, job: _Job, n_slots: int, ok: bool) -> None:
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
        c = self._state.counters
        backoff = self._state.backoff
        if not slots:
            return True
        if not backoff.available():
            c.add("store_failures" if is_store else "load_failures", len(slots))
            return False
        views = [self.pool.chunk_memoryview(s)[: self.payload_bytes] for s in slots]
        try:
            groups = self._groups(spec.redis_keys)
        except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as e:  # no topology
            log.debug("remote: cannot route keys: %s", e)
            backoff.failed()
            c.add("store_failures" if is_store else "load_failures", len(slots))
            return False
        ok = True
        for name, node, idx in groups:
            keys = [spec.redis_keys[i] for i in idx]
            dsts = [views[i] for i in idx]
            try:
                rc = conns.get(name) or conns.setdefault(name, self._connect(node))
                if is_store:
                    good = self._store(rc, keys, dsts)
                else:
                    good = self._load(rc, keys, dsts, [spec.keys[i] for i in idx])
                backoff.succeeded()
            except (*NETWORK_ERRORS, redis.RedisError) as e:  # incl. auth revoked at run time
                log.debug("remote %s to %s failed: %s", "store" if is_store else "load", name, e)
                bad = conns.pop(name, None)
                if bad is not None:
                    bad.close()
                backoff.failed()
                c.add("store_failures" if is_store else "load_failures", len(idx))
                return False
            if not good and self._cluster and rc.last_error and rc.last_error.startswith((b"MOVED", b"ASK")):
                rc.last_error = None
                self._refresh_topology()
            ok = ok and good
        return ok

    def _store(self, rc: RawConnection, keys: list[bytes], views: list[memoryview]) -> bool:
        per_round = max(1, self._cfg.batch_bytes // max(1, self.payload_bytes))
        n_ok = 0
        for i in range(0, len(keys), per_round):
            n_ok += sum(rc.set_many(keys[i : i + per_round], views[i : i + per_round], self._cfg.ttl_s))
        c = self._state.counters
        c.add("stored_bytes", n_ok * self.payload_bytes)
        if n_ok < len(keys):  # e.g. OOM with maxmemory-policy noeviction
            c.add("store_failures", len(keys) - n_ok)
        return n_ok == len(keys)

    def _load(self, rc: RawConnection, keys: list[bytes], views: list[memoryview], offload_keys: list[bytes]) -> bool:
        status = rc.get_many_into(keys, views, self._cfg.batch_bytes)
        c = self._state.counters
        n_ok = status.count(resp.OK)
        c.add("loaded_blocks", n_ok)
        c.add("loaded_bytes", n_ok * self.payload_bytes)
        if n_ok == len(keys):
            return True
        corrupt = [keys[i] for i, s in enumerate(status) if s in _DELETE]
        for i, s in enumerate(status):
            if s != resp.OK:
                self._state.gone_keys.append(offload_keys[i])
            if s in _DELETE:
                c.add(_DELETE[s])
        c.add("load_misses", status.count(resp.MISSING))
        c.add("load_failures", len(keys) - n_ok)
        if corrupt:  # delete so it is not found (and failed) again; the next store rewrites it
            try:
                self._client.delete(*corrupt) if not self._cluster else [self._client.delete(k) for k in corrupt]
            except (redis.RedisError, OSError):
                pass
        return False

    # -- connections ----------------------------------------------------
    def _groups(self, redis_keys: list[bytes]):
        """(connection name, cluster node or None, indices) per server to talk to."""
        if not self._cluster:
            return [("standalone", None, range(len(redis_keys)))]
        groups: dict[str, tuple] = {}
        for i, k in enumerate(redis_keys):
            node = self._client.get_node_from_key(k)
            groups.setdefault(node.name, (node.name, node, []))[2].append(i)
        return list(groups.values())

    def _connect(self, node) -> RawConnection:
        pool = self._client.connection_pool if node is None else self._client.get_redis_connection(node).connection_pool
        return RawConnection(pool.make_connection(), self._codec, self._cfg.min_transfer_mib_s * (1 << 20),
                             self._cfg.socket_timeout_s)

    def _refresh_topology(self) -> None:
        with self._topology_lock:
            try:
                self._client.nodes_manager.initialize()
            except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as e:
                log.warning("remote: cluster topology refresh failed: %s", e)
