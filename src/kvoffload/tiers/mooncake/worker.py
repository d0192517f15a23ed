"""Worker of the Mooncake tier: the Redis tier's job queue, threads and
back-pressure (tiers/remote/worker.py), with transfers done by the
Mooncake client's batched zero-copy calls.

The host pool is registered with the client once, so a value goes out of
and into its pool slot directly: each key is put from, and got into, two
buffers, its 48-byte header (tiers/remote/value.py: binds the value to its
full key, checksum, optional MAC) in a small registered per-thread buffer,
and the chunk in its slot. No chunk is copied in Python; a load is checked
(header, checksum, key, MAC) before it is reported done, and a bad value
is a counted miss, removed from the store so the next store rewrites it.

Hashing runs beside the transfers, never before or after them on the IO
thread (the client's calls and xxhash's update both release the GIL):
- stores: a header thread makes a store job's headers (xxh3 over each
  payload, MAC) when it is submitted and only then queues it, so the IO
  thread's put of one job overlaps the hashing of the next;
- loads: the IO thread hands a round's check (header, xxh3, MAC) to one
  checker thread and goes on with its next batched call; the part is
  reported when its last round is checked. Each IO thread has two
  registered header buffers, so it waits only when both hold rounds still
  being checked. (Halving a lone load's last round, to shorten the check
  left after its bytes arrive, made loads slower: a call of 1-2 values
  moves over fewer of the client's TCP lanes; docs/BENCHMARKS.md.)
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import queue
import threading

from kvoffload.tiers.host_pool import HostPool
from kvoffload.tiers.mooncake.client import (
    INVALID_PARAMS,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    TRANSFER_FAIL,
    network_failed,
    replicate_config,
)
from kvoffload.tiers.mooncake.config import MooncakeConfig
from kvoffload.tiers.remote.state import SharedState
from kvoffload.tiers.remote.value import BAD_MAC, CORRUPT, ERROR, HEADER_BYTES, MISSING, OK, WRONG_KEY, ValueCodec
from kvoffload.tiers.remote.worker import RemoteTierWorker, _Job

log = logging.getLogger(__name__)

_DELETE = {CORRUPT: "checksum_failures", WRONG_KEY: "wrong_key_values", BAD_MAC: "mac_failures"}


def _address(mm: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


class _HeaderBuffer:
    """Registered room for one round's headers, owned by one IO thread."""

    def __init__(self, store, n: int):
        self._store = store
        self._mm = mmap.mmap(-1, max(n * HEADER_BYTES, mmap.PAGESIZE))
        self.view = memoryview(self._mm)
        self.addr = _address(self._mm)
        if store.register_buffer(self.addr, len(self._mm)) != 0:
            raise RuntimeError("mooncake: cannot register the header buffer")

    def close(self) -> None:
        self._store.unregister_buffer(self.addr)


class _HeaderBuffers:
    """An IO thread's two header buffers: one being filled by a batched
    call while the checker reads the other."""

    def __init__(self, store, n: int):
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        self._all = []
        try:
            for _ in range(2):
                self._all.append(_HeaderBuffer(store, n))
        except RuntimeError:
            for hb in self._all:
                hb.close()
            raise
        for hb in self._all:
            self.free.put(hb)

    def close(self) -> None:
        for _ in self._all:  # both back from the checker first
            self.free.get()
        for hb in self._all:
            hb.close()


class _Part:
    """A load part's rounds still being checked."""

    __slots__ = ("job", "n_slots", "rounds_left", "ok")

    def __init__(self, job: _Job, n_slots: int, rounds: int):
        self.job = job
        self.n_slots = n_slots
        self.rounds_left = rounds
        self.ok = True


class MooncakeTierWorker(RemoteTierWorker):
    def __init__(self, pool: HostPool, store, cfg: MooncakeConfig, state: SharedState, codec: ValueCodec):
        self._base = pool.tensor.data_ptr()
        rc = store.register_buffer(self._base, pool.nbytes)
        if rc != 0:
            raise RuntimeError(f"mooncake: cannot register the {pool.nbytes}-byte host pool (code {rc})")
        self._per_round = max(1, cfg.batch_bytes // max(1, pool.used_chunk_bytes))
        # registered now, while the master is known to answer: registering needs it, and an IO
        # thread must not find it gone when it first moves a job
        self._header_sets: queue.SimpleQueue = queue.SimpleQueue()
        try:
            for _ in range(cfg.io_threads):
                self._header_sets.put(_HeaderBuffers(store, self._per_round))
        except RuntimeError:
            self._close_spare_headers()
            store.unregister_buffer(self._base)
            raise
        self._replicate = replicate_config(cfg)
        self._checks: queue.SimpleQueue = queue.SimpleQueue()
        self._parts_lock = threading.Lock()
        self._checker = threading.Thread(target=self._check_loads, name="kvoffload-mooncake-check", daemon=True)
        self._checker.start()
        self._to_hash: queue.SimpleQueue = queue.SimpleQueue()
        super().__init__(pool, store, cfg, state, codec)
        self._hasher = threading.Thread(target=self._hash_stores, name="kvoffload-mooncake-hash", daemon=True)
        self._hasher.start()

    def shutdown(self) -> None:
        self._to_hash.put(None)  # first: it hands the IO threads what it holds
        self._hasher.join(timeout=10)
        super().shutdown()
        self._checks.put(None)  # after the IO threads: nothing more gets queued
        self._checker.join(timeout=10)
        # a thread stuck in a call may still use the buffers
        if not any(t.is_alive() for t in (*self._threads, self._checker, self._hasher)):
            self._close_spare_headers()
            self._client.unregister_buffer(self._base)

    def _close_spare_headers(self) -> None:
        # the sets no IO thread took (each thread closes its own when it ends)
        while not self._header_sets.empty():
            self._header_sets.get_nowait().close()

    def _headers(self, conns: dict) -> _HeaderBuffers:
        """This IO thread's header buffers (one registered set per thread, taken on first use)."""
        return conns.get("headers") or conns.setdefault("headers", self._header_sets.get_nowait())

    # -- a part: a load's transfer here on the IO thread, its check on the checker thread ---
    def _move(self, conns: dict, job: _Job, slots: list[int], spec, headers: bytes | None = None) -> None:
        # conns: this IO thread's own things (here its header buffers); closed when the thread ends
        if not slots:
            return self._part_done(job, 0, True)
        if job.is_store:
            return self._move_store(conns, job, slots, spec, headers)
        c = self._state.counters
        backoff = self._state.backoff
        if not backoff.available():
            c.add("load_failures", len(slots))
            return self._part_done(job, len(slots), False)
        hbs = self._headers(conns)
        n = self._per_round
        starts = range(0, len(slots), n)
        part = _Part(job, len(slots), len(starts))
        for r, i in enumerate(starts):
            sl = slice(i, i + n)
            hb = hbs.free.get()  # waits while both buffers' rounds are being checked
            try:
                codes = self._fetch(hb, slots[sl], spec.redis_keys[sl])
            except Exception:  # noqa: BLE001 - a bug here must fail the job, not kill the thread
                log.exception("mooncake load job %d failed", job.job_id)
                codes = None
            if codes is None:  # the master could not be asked (or a bug): the rest would fail too
                hbs.free.put(hb)
                backoff.failed()
                c.add("load_failures", len(slots) - i)
                self._rounds_done(part, len(starts) - r, False)
                return None
            self._checks.put((part, hbs, hb, slots[sl], spec.redis_keys[sl], spec.keys[sl], codes))
        backoff.succeeded()
        return None

    def _check_loads(self) -> None:
        while (item := self._checks.get()) is not None:
            part, hbs, hb, slots, keys, offload_keys, codes = item
            good = False
            try:
                good = self._verify_round(hb, slots, keys, offload_keys, codes)
            except Exception:  # noqa: BLE001 - a bug here must fail the job, not kill the thread
                log.exception("mooncake load job %d: check failed", part.job.job_id)
            finally:
                hbs.free.put(hb)
            self._rounds_done(part, 1, good)

    def _rounds_done(self, part: _Part, rounds: int, ok: bool) -> None:
        with self._parts_lock:  # the IO thread (on a failure) and the checker both count down
            part.ok = part.ok and ok
            part.rounds_left -= rounds
            done = part.rounds_left == 0
        if done:
            self._part_done(part.job, part.n_slots, part.ok)

    # -- stores: headers made on the header thread, put on the IO thread ---
    def _enqueue(self, q, items: list) -> None:
        if q is self._stores:  # via the header thread, which queues them when their headers are made
            self._to_hash.put(items)
        else:
            super()._enqueue(q, items)

    def _hash_stores(self) -> None:
        while (items := self._to_hash.get()) is not None:
            ready = []
            for job, slots, spec in items:
                headers = None  # the IO thread makes them (or fails the job) if this cannot
                if self._state.backoff.available():  # else the IO thread fails it unhashed
                    try:
                        headers = self._headers_of(slots, spec.redis_keys)
                    except Exception:  # noqa: BLE001 - a bug here must not kill the thread
                        log.exception("mooncake store job %d: making headers failed", job.job_id)
                ready.append((job, slots, spec, headers))
            super()._enqueue(self._stores, ready)

    def _headers_of(self, slots: list[int], keys: list[str]) -> bytes:
        """The 48-byte headers of these slots' values, back to back."""
        payload, codec, chunk = self.payload_bytes, self._codec, self.pool.chunk_memoryview
        return b"".join([codec.header(k.encode(), chunk(s)[:payload]) for s, k in zip(slots, keys)])

    def _move_store(self, conns: dict, job: _Job, slots: list[int], spec, headers: bytes | None) -> None:
        ok = False
        try:
            ok = self._store(conns, slots, spec, headers)
        except Exception:  # noqa: BLE001 - a bug here must fail the job, not kill the thread
            log.exception("mooncake store job %d failed", job.job_id)
            self._state.counters.add("store_failures", len(slots))
        self._part_done(job, len(slots), ok)

    def _store(self, conns: dict, slots: list[int], spec, headers: bytes | None) -> bool:
        """Each round put from a header buffer + the slots."""
        c = self._state.counters
        backoff = self._state.backoff
        if not backoff.available():
            c.add("store_failures", len(slots))
            return False
        if headers is None:
            headers = self._headers_of(slots, spec.redis_keys)
        hbs = self._headers(conns)
        hb = hbs.free.get()
        hview = memoryview(headers)
        try:
            ok, n = True, self._per_round
            for i in range(0, len(slots), n):
                part = slice(i, i + n)
                good = self._put(hb, slots[part], spec.redis_keys[part], hview[i * HEADER_BYTES:])
                if good is None:  # the master could not be asked: the rest would fail too
                    backoff.failed()
                    c.add("store_failures", len(slots) - i)
                    return False
                ok = ok and good
        finally:
            hbs.free.put(hb)
        backoff.succeeded()
        return ok

    def _pointers(self, hb: _HeaderBuffer, slots: list[int]) -> list[list[int]]:
        base, cb, haddr = self._base, self.pool.chunk_bytes, hb.addr
        return [[haddr + j * HEADER_BYTES, base + s * cb] for j, s in enumerate(slots)]

    def _put(self, hb: _HeaderBuffer, slots: list[int], keys: list[str], headers: memoryview) -> bool | None:
        payload, nh = self.payload_bytes, len(keys) * HEADER_BYTES
        hb.view[:nh] = headers[:nh]
        codes = self._client.batch_put_from_multi_buffers(
            keys, self._pointers(hb, slots), [[HEADER_BYTES, payload]] * len(keys), self._replicate)
        if any(network_failed(x) for x in codes):
            return None
        n_ok = sum(x == 0 or x == OBJECT_ALREADY_EXISTS for x in codes)  # already there: another engine stored it
        c = self._state.counters
        c.add("stored_bytes", n_ok * payload)
        if n_ok < len(keys):  # e.g. the store is full (NO_AVAILABLE_HANDLE)
            c.add("store_failures", len(keys) - n_ok)
            log.debug("mooncake put: codes %s", sorted(set(codes)))
        return n_ok == len(keys)

    def _fetch(self, hb: _HeaderBuffer, slots: list[int], keys: list[str]) -> list[int] | None:
        """One batched get of header + slot per key; None: the master could not be asked."""
        codes = self._client.batch_get_into_multi_buffers(
            keys, self._pointers(hb, slots), [[HEADER_BYTES, self.payload_bytes]] * len(keys))
        return None if any(network_failed(x) for x in codes) else codes

    def _verify_round(self, hb: _HeaderBuffer, slots: list[int], keys: list[str], offload_keys: list[bytes],
               codes: list[int]) -> bool:
        """Whether every value fetched is ours and intact; counts and removes the bad ones."""
        payload, codec, view, chunk = self.payload_bytes, self._codec, hb.view, self.pool.chunk_memoryview
        want = HEADER_BYTES + payload
        status = []
        for j, (s, k, code) in enumerate(zip(slots, keys, codes)):
            if code == want:
                header = view[j * HEADER_BYTES : (j + 1) * HEADER_BYTES]
                data = chunk(s)[:payload]
                status.append(codec.verify(k.encode(), header, data) if codec.shape_ok(header, payload)
                              else CORRUPT)
            elif code == OBJECT_NOT_FOUND:
                status.append(MISSING)
            elif code >= 0 or code == INVALID_PARAMS or (code == TRANSFER_FAIL and self._wrong_size(k, want)):
                status.append(CORRUPT)  # a value of another length: not ours
            else:
                status.append(ERROR)
        n_ok = status.count(OK)
        if n_ok < len(keys):
            log.debug("mooncake get: codes %s", sorted(set(codes)))
        c = self._state.counters
        c.add("loaded_blocks", n_ok)
        c.add("loaded_bytes", n_ok * payload)
        if n_ok == len(keys):
            return True
        for i, s in enumerate(status):
            if s != OK:
                self._state.gone_keys.append(offload_keys[i])
            if s in _DELETE:
                c.add(_DELETE[s])
        c.add("load_misses", status.count(MISSING))
        c.add("load_failures", len(keys) - n_ok)
        corrupt = [keys[i] for i, s in enumerate(status) if s in _DELETE]
        if corrupt:  # force: a lease from our own get must not keep it
            try:
                self._client.batch_remove(corrupt, True)
            except Exception as e:  # noqa: BLE001 - best effort; it stays a counted miss
                log.debug("mooncake: removing bad values failed: %s", e)
        return False

    def _wrong_size(self, key: str, want: int) -> bool:
        # TRANSFER_FAIL is also what a shorter value gives: ask its size (error path only)
        size = self._client.get_size(key)
        return size >= 0 and size != want
