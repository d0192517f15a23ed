"""`hubchain`'s split learning: how much older a hub branch's blocks count.

Two classes of blocks: A (the rest) and B (hub branches). A sample of keys
is followed whatever the cache does; each reuse records the distance, in
requests, since its class's last use (4 bins per octave, up to HORIZON).
Each class has its own sampling rate, about TARGET keys per split window
(a capacity/4 evictions), so a minority class is followed in full. With
F_c(L) the share of a class's episodes reused within L and M_c(L) their
mean space-time min(d, L), lives L_A and L_B may take
rate_A M_A(L_A) + rate_B M_B(L_B) <= capacity blocks; the pair with most
hits rate_A F_A(L_A) + rate_B F_B(L_B) gives the target L_A - L_B, and
`shift` moves FOLLOW of the way there at each split (miss-ratio-curve
partitioning, as in Talus or Cliffhanger).

The target stands only while it beats LRU:
- a shadow LRU of a hash sample of the keys (1 in 2**s keys, in a capacity
  2**s times smaller: about SIM_BLOCKS keys) runs beside the cache; while
  the shift is on (at least SIM_ON), the uses where one hit and the other
  missed are counted (decayed by SIM_MEMORY per split). Where they differ
  by SIM_Z standard deviations (a sign test), they decide;
- else the sampled reuses do: LRU keeps every block one life (the longest
  both classes fit in at equal lives); a reuse this cache hit beyond it is
  a gain, one it missed within it a loss; the target stands while gains
  are at least GAIN_OVER_LRU times the losses (decayed by CHECK_MEMORY).

The class constants are HubChainPolicy's (policy.py). With the C loops,
each use is followed at once; with the Python twin, where both samples
take 1 key in 2**_BATCH_FROM or fewer, uses are logged and followed in
batches at the next split (_drain), to the same state.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from itertools import filterfalse, repeat

import numpy as np

from kvoffload.policies.hubchain import loops

BINS = 48  # reuse distances in requests, 4 bins per octave: 1 .. 2^12
HORIZON = 2.0 ** (BINS / 4)  # an episode not reused within this many requests counts as never (at most)
_EDGE = [2.0 ** ((b + 1) / 4) for b in range(BINS)]  # upper distance of each bin
_MID = [(_EDGE[b - 1] if b else 0.0) / 2 + _EDGE[b] / 2 for b in range(BINS)]
A, B = 0, 1  # the classes: the rest, hub branches
_MAX_RATE = 6  # 1 in 64 at most
_WEIGHT = [float(1 << k) for k in range(_MAX_RATE + 1)]  # an episode sampled at 1 in 2**k stands for 2**k
_MAX_SIM_RATE = 8  # the shadow LRU samples 1 in 256 keys at most (one hash byte)
assert _MAX_SIM_RATE < len(loops.SAMPLE_TABLES) and _MAX_RATE < len(loops.SAMPLE_TABLES)
# Uses are followed at each call by loops.follow where its C twin is
# built. Without it (Python), they are logged and followed in batches (_drain)
# where both samples take 1 key in 2**_BATCH_FROM or fewer; else each call at
# once. In bench_manager's driver (following's time, seconds, batched against
# at once, Python): 16,384 blocks (1 in 8) 0.023 against 0.036; 8,192 (1 in 4)
# 0.055 and 0.053; 4,096 (1 in 2) 0.084 against 0.076; 1,024 (every key) 0.190
# against 0.089.
_BATCH_FROM = 2
_DRAIN_KEYS = 65536  # logged key uses before _drain runs anyway (bounds the log's memory)


def _key_ids(ks: list[bytes]) -> tuple[list[bytes], dict[bytes, int], np.ndarray]:
    """The distinct keys (first use first), each one's index, and each use's index."""
    distinct = list(dict.fromkeys(ks))
    ident = dict(zip(distinct, range(len(distinct))))
    return distinct, ident, np.fromiter(map(ident.__getitem__, ks), np.int64, len(ks))


def _bin(d: float) -> int:
    return min(BINS - 1, int(4 * math.log2(d))) if d > 1.0 else 0


_BIN_OF = [_bin(d) for d in range(int(HORIZON) + 1)]  # _bin of a whole distance up to HORIZON
_BIN_ARRAY = np.array(_BIN_OF, np.int64)
_BIN_BYTES = bytes(_BIN_OF)
assert _BIN_OF[-1] == BINS - 1  # a distance of HORIZON or more falls in the last bin

class SplitLearning:
    """The learning's state and steps, mixed into HubChainPolicy (which
    holds the constants, the clock and the capacity)."""

    def _start_learning(self, capacity: int) -> None:
        self.shift = 0.0  # in requests (the clock's unit)
        # Sampled keys -> (start clock << 8) | (rate exponent << 1) | class, oldest start first.
        self._episodes: dict[bytes, int] = {}
        # Per class: keys sampled at 1 in 2**rate; until the first split, about
        # TARGET of the keys a window stores (a window: capacity/4 evictions).
        first = min(_MAX_RATE, max(0, int(math.log2(max(1, capacity) / (4 * self.TARGET)))))
        self._rate = [first, first]
        self._low = first  # the lowest rate exponent of a live episode or a class
        self._live = [0] * (_MAX_RATE + 1)  # live episodes per rate exponent
        self._seen = [0, 0]  # keys used per class since the last split
        self._dist = ([0.0] * (BINS + 1), [0.0] * (BINS + 1))  # per class; the last bin: never reused
        # The same reuses by whether this cache hit or missed them (decayed by
        # CHECK_MEMORY per split): _beats_lru's evidence.
        self._hit_at = [0.0] * BINS
        self._miss_at = [0.0] * BINS
        # The shadow LRU: keys sampled at 1 in 2**s (oldest first), and the
        # uses of them that this cache hit and it missed, or the other way round.
        self._sim_rate = min(_MAX_SIM_RATE, max(0, int(math.log2(max(1, capacity) / self.SIM_BLOCKS))))
        self._sim: OrderedDict[bytes, None] = OrderedDict()
        self._sim_ours = 0.0
        self._sim_lru = 0.0
        self._started = [0.0, 0.0]  # episodes started per class since _since
        self._since = 0
        # Uses logged for _drain: the keys in one list, each call's end in it
        # and (clock << 2) | (class << 1) | hit.
        self._log_keys: list[bytes] = []
        self._log_end: list[int] = []
        self._log_meta: list[int] = []
        self._batched = not loops.NATIVE and min(first, self._sim_rate) >= _BATCH_FROM

    def _follow(self, keys: list[bytes], cls: int, hit: bool) -> None:
        """A use of keys (hit, or stored after a miss). What it feeds (reuse
        distances, the shadow LRU's counts) is read only at a split, and the
        rates and the shift it depends on change only there. So where few
        keys are sampled (1 in 4 or fewer, for both: larger caches) the call
        is only logged (three C-level appends) and _drain follows the batch
        at the next split; where most are, following each call at once is
        cheaper (_follow_now). Both leave the same state."""
        if not self._batched:
            self._follow_now(keys, cls, hit)
            return
        log = self._log_keys
        log.extend(keys)
        self._log_end.append(len(log))
        self._log_meta.append((self._clock << 2) | (cls << 1) | hit)
        if len(log) >= _DRAIN_KEYS:
            self._drain()

    def _follow_now(self, keys: list[bytes], cls: int, hit: bool) -> None:
        """_follow at once (loops.follow): each followed key ends the
        episode it was followed in (a reuse at its distance) and, if sampled,
        starts one of class cls, weighted by its class's sampling rate; the
        shadow LRU sees its sample."""
        self._seen[cls] += len(keys)
        s = self._sim_rate
        started, ours, lru = loops.follow(
            keys, cls, hit, self._clock, self._low, self._rate[cls], s, self._episodes, self._live, self._dist,
            self._hit_at if hit else self._miss_at, self._sim, self.capacity >> s, self.shift >= self.SIM_ON,
            _BIN_BYTES)
        if started:
            self._started[cls] += started
        if ours:
            self._sim_ours += ours
        if lru:
            self._sim_lru += lru

    def _drain(self) -> None:
        """The logged uses, in order, as if each had been followed at its
        call: each followed key ends the episode it was followed in (a reuse
        at its distance) and, if sampled at its class's rate, starts one,
        weighted by that rate; and the shadow LRU sees its sample. Followed
        keys are all in the sample of the lowest rate live (the samples
        nest), so only those are looked at. Float sums add in the calls'
        order, as the calls would have."""
        keys, ends, meta = self._log_keys, self._log_end, self._log_meta
        if not ends:
            return
        self._log_keys, self._log_end, self._log_meta = [], [], []
        n_calls = len(ends)
        lens = np.diff(np.array(ends, np.int64), prepend=0)
        meta_e = np.array(meta, np.int64)
        clock_e, cls_e, hit_e = meta_e >> 2, (meta_e >> 1) & 1, meta_e & 1
        call_of = np.repeat(np.arange(n_calls), lens)  # each key's call
        nb = int(lens[cls_e == B].sum())
        self._seen[A] += len(keys) - nb
        self._seen[B] += nb
        hb = np.frombuffer(loops.hash_bytes(keys), np.uint8)
        s = self._sim_rate
        picked = np.flatnonzero((hb & ((1 << s) - 1)) == 0) if s else np.arange(len(keys))
        if len(picked):
            self._drain_shadow(keys, picked, call_of, hit_e)
        low = self._low
        cand = np.flatnonzero((hb & ((1 << low) - 1)) == 0) if low else np.arange(len(keys))
        if len(cand):
            self._drain_episodes(keys, hb, cand, call_of, clock_e, cls_e, hit_e)

    def _drain_shadow(self, keys: list[bytes], picked: np.ndarray, call_of: np.ndarray,
                      hit_e: np.ndarray) -> None:
        """The shadow LRU's uses in the batch (`picked`: its sampled keys)."""
        calls = call_of[picked]
        if self.shift >= self.SIM_ON:  # counting: call by call, against the shadow at each call
            cuts = np.flatnonzero(np.diff(calls)) + 1
            get = keys.__getitem__
            for part, c in zip(np.split(picked, cuts), calls[np.r_[0, cuts]].tolist()):
                self._shadow(list(map(get, part.tolist())), bool(hit_e[c]))
            return
        # Not counting: only the end state matters. With the oldest trimmed
        # after each call, the shadow holds the newest `capacity >> s` keys by
        # last use, so the uses can be applied at once. A call makes its head
        # newest; a key twice in one call takes its later place (the older).
        distinct, ident, ids = _key_ids(list(map(keys.__getitem__, picked.tolist())))
        by = np.lexsort((picked, calls, ids))
        ids, calls, pos = ids[by], calls[by], picked[by]
        last = np.ones(len(ids), bool)
        last[:-1] = ids[1:] != ids[:-1]  # each key's last call, its last place there
        ids, calls, pos = ids[last], calls[last], pos[last]
        used = list(map(distinct.__getitem__, ids[np.lexsort((-pos, calls))].tolist()))  # oldest use first
        kept = list(filterfalse(ident.__contains__, self._sim))  # not used since: older, in their order
        kept.extend(used)
        self._sim = OrderedDict.fromkeys(kept[-(self.capacity >> self._sim_rate):])

    def _drain_episodes(self, keys: list[bytes], hb: np.ndarray, cand: np.ndarray, call_of: np.ndarray,
                        clock_e: np.ndarray, cls_e: np.ndarray, hit_e: np.ndarray) -> None:
        """The episodes' uses in the batch (`cand`: keys in the lowest rate's
        sample), grouped by key with a sort: a use ends the episode the key's
        previous use started, in this batch or an earlier one."""
        distinct, _, ids = _key_ids(list(map(keys.__getitem__, cand.tolist())))
        order = np.lexsort((cand, ids))  # each key's uses together, in time order
        ids, pos = ids[order], cand[order]
        calls = call_of[pos]
        keep = np.ones(len(ids), bool)  # a key twice in one call: one use (its first)
        keep[1:] = (ids[1:] != ids[:-1]) | (calls[1:] != calls[:-1])
        if not keep.all():
            ids, pos, calls = ids[keep], pos[keep], calls[keep]
        n = len(ids)
        first = np.ones(n, bool)
        first[1:] = ids[1:] != ids[:-1]
        last = np.ones(n, bool)
        last[:-1] = first[1:]
        cls_u, clock_u, hit_u = cls_e[calls], clock_e[calls], hit_e[calls]
        rate_u = np.array(self._rate, np.int64)[cls_u]
        starts = (hb[pos].astype(np.int64) & ((1 << rate_u) - 1)) == 0
        live, episodes = self._live, self._episodes
        # Ended by a use in this batch: the key's previous use started one.
        inner = np.flatnonzero(~first[1:] & starts[:-1]) + 1
        end_pos = [pos[inner]]
        end_d = [clock_u[inner] - clock_u[inner - 1]]
        end_k = [rate_u[inner - 1]]
        end_cls = [cls_u[inner - 1]]
        end_hit = [hit_u[inner]]
        # Ended by a key's first use here: an episode from an earlier batch.
        fu = np.flatnonzero(first)
        prior = np.array(list(map(episodes.pop, map(distinct.__getitem__, ids[fu].tolist()), repeat(-1))), np.int64)
        was = prior >= 0
        if was.any():
            e, u = prior[was], fu[was]
            ek = (e >> 1) & 127
            for k, c in enumerate(np.bincount(ek).tolist()):
                live[k] -= c
            end_pos.append(pos[u])
            end_d.append(clock_u[u] - (e >> 8))
            end_k.append(ek)
            end_cls.append(e & 1)
            end_hit.append(hit_u[u])
        ep = np.concatenate(end_pos)
        if len(ep):
            by = np.argsort(ep, kind="stable")  # the calls' order, each call's keys in order
            d = np.concatenate(end_d)[by]
            b = _BIN_ARRAY[np.minimum(d, len(_BIN_OF) - 1)]  # (the last entry is the last bin)
            w = np.ldexp(1.0, np.concatenate(end_k)[by])
            c, h = np.concatenate(end_cls)[by], np.concatenate(end_hit)[by]
            # np.add.at adds one element at a time in order: the same sums, to
            # the last bit, as the calls' own adds would give
            for target, mask in ((self._dist[A], c == A), (self._dist[B], c == B),
                                 (self._miss_at, h == 0), (self._hit_at, h == 1)):
                if mask.any():
                    acc = np.array(target[:BINS])
                    np.add.at(acc, b[mask], w[mask])
                    target[:BINS] = acc.tolist()
        # Started: weighted per class, added call by call as the calls did.
        su = np.flatnonzero(starts)
        if len(su):
            w = np.ldexp(1.0, rate_u[su])
            for cls in (A, B):
                mine = cls_u[su] == cls
                if mine.any():
                    per_call = np.bincount(calls[su][mine], weights=w[mine])
                    total = self._started[cls]
                    for v in per_call[per_call > 0].tolist():
                        total += v
                    self._started[cls] = total
            # Still open: a key's last use here started one (oldest start first).
            op = np.flatnonzero(last & starts)
            if len(op):
                op = op[np.argsort(pos[op], kind="stable")]
                packed = (clock_u[op] << 8) | (rate_u[op] << 1) | cls_u[op]
                episodes.update(zip(map(distinct.__getitem__, ids[op].tolist()), packed.tolist()))
                for k, c in enumerate(np.bincount(rate_u[op]).tolist()):
                    live[k] += c

    def _shadow(self, keys: list[bytes], hit: bool) -> None:
        """A use of the shadow LRU's keys (all hits or all misses here):
        loops.shadow, counting while the shift is on."""
        ours, lru = loops.shadow(self._sim, keys, hit, self.capacity >> self._sim_rate, self.shift >= self.SIM_ON)
        if ours:
            self._sim_ours += ours
        if lru:
            self._sim_lru += lru

    def _split(self) -> None:
        """shift from the lives that serve most hits within the capacity."""
        self._drain()
        now, episodes = self._clock, self._episodes
        span = max(1, now - self._since)
        rates = [x / span for x in self._started]  # episodes per request
        # An episode older than the longest life a class could have (the whole
        # cache to itself) will not be served by any split: count it as never.
        horizon = min(HORIZON, self.capacity / max(min(rates), 1e-9))
        old = []  # (oldest start first: one walk, not next(iter()) per key, which rescans the holes deletes leave)
        for item in episodes.items():
            if now - (item[1] >> 8) <= horizon:
                break
            old.append(item)
        for k, e in old:
            del episodes[k]
            ek = (e >> 1) & 127
            self._live[ek] -= 1
            self._dist[e & 1][BINS] += _WEIGHT[ek]
        curves = []
        for cls in (A, B):
            h = self._dist[cls]
            n = sum(h)
            if n < self.MIN_EPISODES:
                return
            rate = rates[cls]
            hits, space, cum, part = [], [], 0.0, 0.0
            for b in range(BINS):
                cum += h[b]
                part += h[b] * _MID[b]
                hits.append(rate * cum / n)
                space.append(rate * (part + _EDGE[b] * (n - cum)) / n)
            curves.append((hits, space))
        (hits_a, space_a), (hits_b, space_b) = curves
        best, best_a, best_b = -1.0, 0, -1
        jb = BINS - 1
        for ba in range(BINS):
            room = self.capacity - space_a[ba]
            if room < 0:
                break
            while jb >= 0 and space_b[jb] > room:
                jb -= 1  # B's longest life in the room left (room shrinks as ba grows)
            got = hits_a[ba] + (hits_b[jb] if jb >= 0 else 0.0)
            if got > best:
                best, best_a, best_b = got, ba, jb
        if best >= 0:
            target = max(0.0, _EDGE[best_a] - (_EDGE[best_b] if best_b >= 0 else 0.0))
            if target and not self._beats_lru(space_a, space_b):
                target = 0.0
            self.shift += self.FOLLOW * (target - self.shift)
        for met in (self._hit_at, self._miss_at):
            for b in range(BINS):
                met[b] *= self.CHECK_MEMORY
        for h in self._dist:  # forget slowly: follow the workload
            for b in range(BINS + 1):
                h[b] *= 0.5
        self._started = [x * 0.5 for x in self._started]
        self._since = now - span // 2
        # Each class's rate for the next window: about TARGET keys of it sampled
        # (a minority class, e.g. the few continued chains on Mooncake, fully).
        self._rate = [min(_MAX_RATE, max(0, int(math.log2(max(1, n) / self.TARGET)))) for n in self._seen]
        self._seen = [0, 0]
        self._low = min(self._rate + [k for k, n in enumerate(self._live) if n])
        self._batched = not loops.NATIVE and min(self._low, self._sim_rate) >= _BATCH_FROM

    def _beats_lru(self, space_a: list[float], space_b: list[float]) -> bool:
        """Whether the shift pays against LRU. The shadow LRU decides where
        the uses it and this cache disagreed on (while the shift was on) lean
        one way by SIM_Z standard deviations. Else the sampled reuses do:
        LRU keeps every block for one life (the longest both classes' space
        fits in the capacity), so a reuse we hit beyond it is a gain and one
        we missed within it a loss. The split's model can be wrong where it
        cannot see (`convo` at 1%: a small class A whose oldest block's age
        swings evicts hub branches well before their modeled life)."""
        ours, lru = self._sim_ours, self._sim_lru
        margin = self.SIM_Z * math.sqrt(ours + lru)  # a sign test on the uses they disagree on
        if lru - ours > margin:
            return False
        if ours - lru > margin:
            return True
        life = 0
        while life + 1 < BINS and space_a[life + 1] + space_b[life + 1] <= self.capacity:
            life += 1
        return sum(self._hit_at[life + 1:]) >= self.GAIN_OVER_LRU * sum(self._miss_at[:life + 1])

