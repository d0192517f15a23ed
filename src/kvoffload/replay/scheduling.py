"""The simulated scheduler's side of a replay step: first sight of a
request, lookups in prefix order, GPU blocks, prepare_load.

A mixin of ReplayEngine (engine.py): it reads and writes the engine's state.
"""

from __future__ import annotations

import zlib
from collections import deque

import numpy as np

from kvoffload.abstractions import OffloadPolicy, ReqContext
from kvoffload.replay.contents import seeds_of
from kvoffload.replay.state import Job, Running, Seen
from kvoffload.replay.traces import Request, mix64


# An offload key of group 0, as make_offload_key builds it: the block hash
# (8 bytes, big-endian), then the group index (4 bytes, big-endian).
_KEY = np.dtype([("hash", ">u8"), ("group", ">u4")])


def offload_keys(seeds: np.ndarray) -> list[bytes]:
    """The keys of blocks given by their seeds (their hashes as int64), made
    by numpy from the array the contents need anyway: per block, only the
    bytes object itself is made in Python."""
    rec = np.zeros(len(seeds), dtype=_KEY)
    rec["hash"] = seeds.view(np.uint64)
    return rec.view(np.dtype((np.void, _KEY.itemsize))).tolist()


def unique_hashes(req: Request, n: int) -> list[int]:
    """Hashes for decode blocks the trace does not describe: no prompt matches them."""
    base = zlib.crc32(req.req_id.encode()) << 32
    return [mix64(base ^ (i + 0xDEC0DE)) for i in range(n)]


class Scheduling:
    def _first_sight(self, req: Request, step: int) -> Seen:
        """on_new_request, with the request's keys and their positions."""
        ctx = ReqContext(req.req_id, req.kv_transfer_params)
        seeds = req.hash_array
        if seeds is None or len(seeds) != len(req.block_hashes):
            seeds = seeds_of(req.block_hashes)
        keys, positions = self._keys_sharing_prefix(seeds)
        ctx.share_offload_key_positions(positions)
        roc = self.mgr.on_new_request(ctx)
        seen = self._seen[req.req_id] = Seen(ctx, keys, seeds, roc.policy == OffloadPolicy.REQUEST_LEVEL,
                                             index=self._arrived, first_step=step)
        self._arrived += 1
        if self._primary is not None:
            slot_of = self._primary.slot_of
            seen.absent = {k for k in keys if slot_of(k) is None}
        return seen

    def _keys_sharing_prefix(self, seeds: np.ndarray) -> tuple[list[bytes], dict[bytes, int]]:
        """The blocks' keys and their end-token positions, sharing the bytes
        objects of the last request that began with the same block as far as
        both agree (a conversation's next turn repeats its context): equal
        keys are then the same object, so the manager's dict lookups end at
        the identity check, and the replay makes and holds one object per
        block instead of one per reference. The positions dict starts as a
        copy of that request's (a C-level copy, ~10x cheaper than building
        it pair by pair), less the keys past where the two differ."""
        bs = self.trace.block_size
        if not len(seeds):
            return [], {}
        first = int(seeds[0])
        last = self._last_by_head.get(first)
        if last is None:
            n, keys, positions = 0, [], {}
        else:
            old_seeds, old_keys, old_positions = last
            m = min(len(seeds), len(old_seeds))
            differ = np.flatnonzero(seeds[:m] != old_seeds[:m])
            n = int(differ[0]) if len(differ) else m
            keys = old_keys[:n]
            if n * 2 >= len(old_keys) and len(old_positions) == len(old_keys):  # (no key listed twice)
                positions = old_positions.copy()
                for k in old_keys[n:]:
                    del positions[k]
            else:
                positions = dict(zip(keys, range(bs, (n + 1) * bs, bs)))
        if n < len(seeds):
            new = offload_keys(seeds[n:])
            keys += new
            positions.update(zip(new, range((n + 1) * bs, (len(seeds) + 1) * bs, bs)))
        if len(positions) != len(keys):  # a key listed twice: the last position, as a plain update gives
            positions = dict(zip(keys, range(bs, (len(keys) + 1) * bs, bs)))
        self._last_by_head[first] = (seeds, keys, positions)
        return keys, positions

    def _schedule(self, waiting: deque) -> list[str]:
        """Start waiting requests while there is room (lookups, GPU blocks,
        prepare_load); returns their ids."""
        new_ids: list[str] = []
        self._step_tokens = 0  # tokens prefilled this step (the simulated clock)
        mgr = self.mgr
        c = self.c
        vllm = self.opts.order == "vllm"
        step = int(c["steps"])
        skipped: list[tuple[Request, int]] = []  # delayed: first in line next step, as in vLLM
        for _ in range(len(waiting)):
            if len(self.running) >= self.opts.max_running:
                break
            req, delays = waiting.popleft()
            seen = self._seen.get(req.req_id)
            hashes = req.block_hashes
            if seen is None:
                seen = self._first_sight(req, step)
            if seen.jobs:  # vLLM looks a request up only once its transfers have landed
                c["delayed_for_transfers"] += 1
                skipped.append((req, delays))
                continue
            ctx, keys, seeds = seen.ctx, seen.keys, seen.seeds
            n_gpu = self.gpu.match(hashes)
            n_off, pending = mgr.lookup_prefix(keys[n_gpu:] if n_gpu else keys, ctx)
            if pending is not None:
                seen.pending.add(pending)
                if delays < self.opts.max_delay_steps:
                    c["delayed_lookups"] += 1
                    skipped.append((req, delays + 1))
                    continue
                c["delay_timeouts"] += 1
            n_dec = self._num_decode_blocks(req)
            n_new = len(hashes) - n_gpu + n_dec
            if not self.gpu.can_allocate(n_new, hashes[:n_gpu] if n_gpu else ()):
                waiting.appendleft((req, delays))  # running requests hold the GPU: try next step
                break
            # the hits first: fresh blocks may evict idle cached ones, never this request's hits
            hit = self.gpu.acquire(hashes[:n_gpu]) if n_gpu else None
            fresh = self._allocate(n_new)
            slots = np.concatenate((np.array(hit, dtype=np.int64), fresh)) if n_gpu else fresh
            if n_dec:
                dec = req.decode_hashes if req.decode_hashes is not None else unique_hashes(req, n_dec)
                dec_seeds = seeds_of(dec)
                keys = keys + offload_keys(dec_seeds)
                if self.gpu.track:  # (the hashes serve the GPU prefix cache alone)
                    hashes = hashes + list(dec)
                seeds = np.concatenate((seeds, dec_seeds))
            run = Running(req, ctx, keys, hashes, slots, n_gpu, n_off, seeds,
                          request_level=seen.request_level, jobs=seen.jobs, seen=seen, first_step=step,
                          resumed=seen.preempted)
            self.running.append(run)
            new_ids.append(req.req_id)
            plen = len(req.block_hashes)
            if vllm:
                # vLLM's update_state_after_alloc: a chunk-level request stores
                # from past its hits; without an external hit, from its start
                if n_off and not seen.request_level:
                    seen.offered = n_gpu + n_off
                run.phase = "loading" if n_off else "prefill"
            else:
                # vLLM touches every block of the request, GPU-cached ones too; before
                # the store below, so this request's own blocks are not its victims.
                mgr.touch(keys[:plen], ctx)
            if not seen.preempted:
                c["requests"] += 1
            c["prompt_tokens"] += req.prompt_tokens
            c["block_refs"] += plen
            c["gpu_hit_blocks"] += n_gpu
            c["offload_hit_blocks"] += n_off
            if seen.pending:
                # answered HIT_PENDING first: promoted from a lower tier (or a
                # store in flight) before this request could load it
                was = seen.pending
                c["offload_hit_blocks_after_pending"] += sum(k in was for k in keys[n_gpu:n_gpu + n_off])
            if seen.absent is not None and n_off:
                # the CPU tier lacked it at first sight and the engine did not
                # store it since: a lower tier supplied it (look-ahead included)
                absent, stored, since = seen.absent, self._cpu_stored, seen.first_step
                run.promoted = {i for i in range(n_gpu, n_gpu + n_off)
                                if keys[i] in absent and stored.get(keys[i], -1) < since}
                c["offload_hit_blocks_promoted"] += len(run.promoted)
            g_tok = self.tokens_in(req, 0, n_gpu)
            o_tok = self.tokens_in(req, n_gpu, n_gpu + n_off)
            c["gpu_hit_tokens"] += g_tok
            c["offload_hit_tokens"] += o_tok
            c["recomputed_tokens"] += req.prompt_tokens - g_tok - o_tok
            if not vllm:  # (the vllm order counts each chunk as it is computed)
                self._step_tokens += req.prompt_tokens - g_tok - o_tok
                self._step_decode += req.output_tokens
            if n_off:
                self._prepare_load(run)
        waiting.extendleft(reversed(skipped))
        return new_ids

    def _allocate(self, n: int) -> np.ndarray | None:
        """Fresh GPU slots; a store still reading one of them is waited for
        first (vLLM's flush of a job whose blocks are re-allocated)."""
        fresh = self.gpu.allocate(n)
        if fresh is not None and len(fresh):
            fenced = self._fence[fresh]
            if not fenced.any():
                return fresh
            self._fence[fresh] = 0
            jobs = set(fenced[fenced > 0].tolist())
            jobs.intersection_update(self._jobs)
            if jobs:
                self.c["fence_waits"] += 1
                self.wrk.wait(jobs)
        return fresh

    def _prepare_load(self, run: Running) -> None:
        """prepare_load now; the worker gets the job now (legacy) or in this
        step's worker phase (vllm order, after the flushed stores)."""
        lo, hi = run.n_gpu, run.n_gpu + run.n_off
        keys = run.keys[lo:hi]
        src = self.mgr.prepare_load(keys, run.ctx)
        job = Job(run, True, keys, run.slots[lo:hi], run.seeds[lo:hi], lo, src)
        if self.opts.order == "vllm":
            self._to_submit.append(job)
        else:
            self._submit(job)
