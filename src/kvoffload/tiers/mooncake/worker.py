"""Worker of the Mooncake tier: the Redis tier's job queue, threads and
back-pressure (tiers/remote/worker.py), with transfers done by the
Mooncake client's batched zero-copy calls.

The host pool is registered with the client once, so a value goes out of
and into its pool slot directly, as ONE buffer per key: the chunk followed
by its 48-byte header (tiers/remote/value.py: binds the value to its full
key, checksum, optional MAC) as a trailer, in the slot's trailer room
(HostPool(trailer_bytes=HEADER_BYTES); the tiered spec asks for it). The
client's TCP transport pays for every extra slice of a multi-buffer value,
so one buffer per key puts and gets as fast as its plain calls (a header
buffer + slot ran at ~0.83 of them; docs/BENCHMARKS.md). No chunk is copied
in Python; a load is checked (header, checksum, key, MAC) before it is
reported done, and a bad value is a counted miss, removed from the store so
the next store rewrites it. A value of the old header-first layout (same
length) fails the check: its last 48 bytes are chunk bytes, not a header.

Hashing runs beside the transfers, never before or after them on the IO
threads (the client's calls and xxhash's update both release the GIL), on
a few hashing threads (hashing.py), checks before headers; what overlaps
no transfer (a lone store job's headers, a last round's check with no
other load queued or moving) is cut into a piece per thread, to run on
every free core:
- stores: a store job's headers (xxh3 over each payload, MAC) are written
  into its slots' trailers when it is submitted, and only then is it
  queued, so the IO thread's put of one job overlaps the hashing of the
  next;
- loads: the IO thread hands a round's check (trailer, xxh3, MAC) to the
  hashing threads and goes on with its next batched call; the part is
  reported when its last round is checked. (Halving a lone load's last
  round, to shorten the check left after its bytes arrive, made loads
  slower: a call of 1-2 values moves over fewer of the client's TCP lanes;
  docs/BENCHMARKS.md.)
A load is split over the IO threads only into parts of whole rounds: the
client moves one call's values over several TCP lanes itself, and calls
of fewer values from more threads are slower (0.5-0.9 of the same values
in calls of 16; docs/BENCHMARKS.md).
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial

from kvoffload.tiers.base import even_runs
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
from kvoffload.tiers.mooncake.hashing import HashThreads
from kvoffload.tiers.remote.state import SharedState
from kvoffload.tiers.remote.value import BAD_MAC, CORRUPT, ERROR, HEADER_BYTES, MISSING, OK, WRONG_KEY, ValueCodec
from kvoffload.tiers.remote.job import TransferJob
from kvoffload.tiers.remote.worker import RemoteTierWorker

log = logging.getLogger(__name__)

SLOW_TRANSFER_FAIL_S = 0.5
_DELETE = {CORRUPT: "checksum_failures", WRONG_KEY: "wrong_key_values", BAD_MAC: "mac_failures"}


class _Part:
    """A load part's check pieces still to run, or a store job's header
    pieces (then `ready` is what to queue for the IO threads once done)."""

    __slots__ = ("job", "n_slots", "pieces_left", "ok", "ready")

    def __init__(self, job: TransferJob, n_slots: int, pieces: int, ready: tuple | None = None):
        self.job = job
        self.n_slots = n_slots
        self.pieces_left = pieces
        self.ok = True
        self.ready = ready


class MooncakeTierWorker(RemoteTierWorker):
    def __init__(self, pool: HostPool, store, cfg: MooncakeConfig, state: SharedState, codec: ValueCodec):
        if pool.chunk_bytes - pool.used_chunk_bytes < HEADER_BYTES:
            raise ValueError(f"mooncake tier: host pool slots of {pool.chunk_bytes} B leave no room for the "
                             f"{HEADER_BYTES}-byte header after {pool.used_chunk_bytes}-byte chunks "
                             f"(build the pool with trailer_bytes={HEADER_BYTES})")
        self._base = pool.tensor.data_ptr()
        rc = store.register_buffer(self._base, pool.nbytes)
        if rc != 0:
            raise RuntimeError(f"mooncake: cannot register the {pool.nbytes}-byte host pool (code {rc})")
        self._per_round = max(1, cfg.batch_bytes // max(1, pool.used_chunk_bytes))
        self._replicate = replicate_config(cfg)
        self._parts_lock = threading.Lock()
        self._loads_moving = 0  # load parts on the IO threads now (under _parts_lock)
        # two at least: a lone job's hashing that overlaps no transfer then runs on two cores
        self._hash = HashThreads(max(2, cfg.io_threads))
        super().__init__(pool, store, cfg, state, codec)
        self._value_bytes = self.payload_bytes + HEADER_BYTES  # chunk + trailer: one buffer per key

    def shutdown(self) -> None:
        self._hash.wait_background(10)  # first: every store job's headers made, the job with the IO threads
        super().shutdown()
        self._hash.stop(10)  # after the IO threads: no more checks get queued
        # a thread stuck in a call may still use the pool
        if not any(t.is_alive() for t in (*self._threads, *self._hash.threads)):
            self._client.unregister_buffer(self._base)

    def _parts(self, n: int) -> list[tuple[int, int]]:
        """A load's parts for the IO threads: whole rounds (batched calls of up to
        _per_round values), never more parts than threads."""
        k = max(1, min(len(self._threads), -(-n // self._per_round)))
        return even_runs(n, k)

    # -- a part: a load's transfer here on the IO thread, its check on the hashing threads ---
    def _move(self, conns: dict, job: TransferJob, slots: list[int], spec, headers_made: bool = False) -> None:
        if not slots:
            return self._part_done(job, 0, True)
        if job.is_store:
            return self._move_store(job, slots, spec, headers_made)
        c = self._state.counters
        backoff = self._state.transfer_backoff
        if not backoff.available():
            c.add("load_failures", len(slots))
            return self._part_done(job, len(slots), False)
        with self._parts_lock:
            self._loads_moving += 1
        try:
            self._fetch_rounds(job, slots, spec)
        finally:
            with self._parts_lock:
                self._loads_moving -= 1
        return None

    def _fetch_rounds(self, job: TransferJob, slots: list[int], spec) -> None:
        c = self._state.counters
        backoff = self._state.transfer_backoff
        n = self._per_round
        starts = range(0, len(slots), n)
        part = _Part(job, len(slots), len(starts))  # a piece per round; more for a last round split up
        for r, i in enumerate(starts):
            rs, rk, ro = slots[i:i + n], spec.redis_keys[i:i + n], spec.keys[i:i + n]
            try:
                codes = self._fetch(rs, rk)
            except Exception:  # noqa: BLE001 - a bug here must fail the job, not kill the thread
                log.exception("mooncake load job %d failed", job.job_id)
                codes = None
            if codes is None:  # the master or a store node could not be asked (or a bug): the rest would fail too
                backoff.failed()
                c.add("load_failures", len(slots) - i)
                self._pieces_done(part, len(starts) - r, False)
                return None
            # a round's check overlaps the next get, in one piece; a last round's, with no other load
            # queued or moving, overlaps nothing: on every hashing thread
            pieces = [(0, len(rs))]
            if r == len(starts) - 1 and self._last_load():
                pieces = self._hash.pieces(len(rs), self._value_bytes)
                with self._parts_lock:
                    part.pieces_left += len(pieces) - 1
            self._hash.run_soon([partial(self._check_piece, part, rs[a:b], rk[a:b], ro[a:b], codes[a:b])
                                 for a, b in pieces], urgent=True)
        backoff.succeeded()
        return None

    def _last_load(self) -> bool:
        """No load but the caller's is queued or on an IO thread."""
        with self._parts_lock:
            return self._loads_moving == 1 and not self._loads

    def _check_piece(self, part: _Part, slots: list[int], keys: list[str], offload_keys: list[bytes],
                     codes: list[int]) -> None:
        good = False
        try:
            good = self._verify_round(slots, keys, offload_keys, codes)
        except Exception:  # noqa: BLE001 - a bug here must fail the job, not kill the thread
            log.exception("mooncake load job %d: check failed", part.job.job_id)
        self._pieces_done(part, 1, good)

    def _pieces_done(self, part: _Part, pieces: int, ok: bool) -> None:
        with self._parts_lock:  # the IO thread (on a failure) and the hashing threads all count down
            part.ok = part.ok and ok
            part.pieces_left -= pieces
            done = part.pieces_left == 0
        if not done:
            return
        if part.ready is not None:  # a store job's headers: the IO threads may put it now
            job, slots, spec = part.ready
            super()._enqueue(self._stores, [(job, slots, spec, part.ok)])
        else:
            self._part_done(part.job, part.n_slots, part.ok)

    # -- stores: headers written into the slots' trailers on the hashing threads, put on the IO thread ---
    def _enqueue(self, q, items: list) -> None:
        if q is not self._stores:
            return super()._enqueue(q, items)
        for job, slots, spec in items:  # queued for the IO threads once their headers are made
            if not slots or not self._state.transfer_backoff.available():  # the IO thread fails it unhashed
                super()._enqueue(q, [(job, slots, spec, False)])
                continue
            with self._cond:  # the only store in flight: the IO threads wait for its headers, nothing overlaps
                alone = self._queued_store_bytes == len(slots) * self.payload_bytes
            pieces = self._hash.pieces(len(slots), self._value_bytes) if alone else [(0, len(slots))]
            pending = _Part(job, len(slots), len(pieces), ready=(job, slots, spec))
            self._hash.run_soon([partial(self._header_piece, pending, slots[a:b], spec.redis_keys[a:b])
                                 for a, b in pieces], urgent=False)
        return None

    def _header_piece(self, pending: _Part, slots: list[int], keys: list[str]) -> None:
        made = False  # then the IO thread makes them all (or fails the job)
        try:
            self._write_headers(slots, keys)
            made = True
        except Exception:  # noqa: BLE001 - a bug here must not kill the thread
            log.exception("mooncake store job %d: making headers failed", pending.job.job_id)
        self._pieces_done(pending, 1, made)

    def _write_headers(self, slots: list[int], keys: list[str]) -> None:
        """Each slot's value header into its trailer, right after the payload."""
        payload, codec, chunk = self.payload_bytes, self._codec, self.pool.chunk_memoryview
        end = payload + HEADER_BYTES
        for s, k in zip(slots, keys):
            m = chunk(s)
            m[payload:end] = codec.header(k.encode(), m[:payload])

    def _move_store(self, job: TransferJob, slots: list[int], spec, headers_made: bool) -> None:
        ok = False
        try:
            ok = self._store(slots, spec, headers_made)
        except Exception:  # noqa: BLE001 - a bug here must fail the job, not kill the thread
            log.exception("mooncake store job %d failed", job.job_id)
            self._state.counters.add("store_failures", len(slots))
        self._part_done(job, len(slots), ok)

    def _store(self, slots: list[int], spec, headers_made: bool) -> bool:
        """Each round put from its slots, one buffer (chunk + trailer) per key."""
        c = self._state.counters
        backoff = self._state.transfer_backoff
        if not backoff.available():
            c.add("store_failures", len(slots))
            return False
        if not headers_made:
            self._write_headers(slots, spec.redis_keys)
        ok, n = True, self._per_round
        for i in range(0, len(slots), n):
            part = slice(i, i + n)
            good = self._put(slots[part], spec.redis_keys[part])
            if good is None:  # the master or a store node could not be asked: the rest would fail too
                backoff.failed()
                c.add("store_failures", len(slots) - i)
                return False
            ok = ok and good
        backoff.succeeded()
        return ok

    def _pointers(self, slots: list[int]) -> list[int]:
        base, cb = self._base, self.pool.chunk_bytes
        return [base + s * cb for s in slots]

    def _put(self, slots: list[int], keys: list[str]) -> bool | None:
        t0 = time.monotonic()
        codes = self._client.batch_put_from(keys, self._pointers(slots), [self._value_bytes] * len(keys),
                                            self._replicate)
        if any(network_failed(x) for x in codes) or self._timed_out(codes, t0):
            return None
        n_ok = sum(x == 0 or x == OBJECT_ALREADY_EXISTS for x in codes)  # already there: another engine stored it
        c = self._state.counters
        c.add("stored_bytes", n_ok * self.payload_bytes)
        if n_ok < len(keys):  # e.g. the store is full (NO_AVAILABLE_HANDLE)
            c.add("store_failures", len(keys) - n_ok)
            log.debug("mooncake put: codes %s", sorted(set(codes)))
        return n_ok == len(keys)

    def _fetch(self, slots: list[int], keys: list[str]) -> list[int] | None:
        """One batched get of chunk + trailer per key into its slot; None: the master could not be asked."""
        t0 = time.monotonic()
        codes = self._client.batch_get_into(keys, self._pointers(slots), [self._value_bytes] * len(keys))
        return None if any(network_failed(x) for x in codes) or self._timed_out(codes, t0) else codes

    @staticmethod
    def _timed_out(codes: list[int], t0: float) -> bool:
        """A slow TRANSFER_FAIL: a store node gone (the client retries its connection for 1 s) or not
        answering (transfer_timeout_s); that backs off like a master that cannot be asked. A value of
        another size fails within milliseconds: not this."""
        return TRANSFER_FAIL in codes and time.monotonic() - t0 >= SLOW_TRANSFER_FAIL_S

    def _verify_round(self, slots: list[int], keys: list[str], offload_keys: list[bytes],
                      codes: list[int]) -> bool:
        """Whether every value fetched is ours and intact; counts and removes the bad ones."""
        payload, codec, chunk = self.payload_bytes, self._codec, self.pool.chunk_memoryview
        want, end = self._value_bytes, payload + HEADER_BYTES
        status = []
        for s, k, code in zip(slots, keys, codes):
            if code == want:
                m = chunk(s)
                header = m[payload:end]
                status.append(codec.verify(k.encode(), header, m[:payload]) if codec.shape_ok(header, payload)
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
