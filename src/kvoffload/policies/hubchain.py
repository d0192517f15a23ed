"""`segchain` that lets branches off a hub age faster, with ARC's frequency split ("hubchain").

A hub is a block that many requests branch from: a shared system prompt, a
few-shot preamble, a tool schema. A request whose resident prefix ends at a
hub starts a new branch there (a first turn, a one-shot prompt). On some
workloads most such branches are never read again (Mooncake: 61% of
conversations end after one turn; one-shot prompts after a preamble), and
ARC wins there by evicting blocks used once before blocks used again. On
others (chats, a system prompt with a tail of users) they are read again
soon, and LRU wins. So:

- A branch request's blocks (all its stores) are kept in a third order,
  beside `segchain`'s chain and loose orders (same clock: requests). For
  eviction their last use counts `shift` older than it is; the oldest of
  the three heads goes first. With shift 0 (and p at the capacity, below)
  this is `segchain` but for ties, which is LRU where no chain rule fires.
  A branch block's first hit, or a re-store of a key evicted recently
  (ARC's ghost hit), puts it in the chain order.
- `shift` splits the cache between the two classes (branch blocks B, the
  rest A) the way that serves most hits, from their reuse distances
  (miss-ratio-curve partitioning, as in Talus or Cliffhanger): a sample of
  keys is followed whatever the cache does, and each reuse records the
  distance since its class's last use (in requests; 4 bins per octave, up
  to HORIZON). Each class has its own sampling rate, about TARGET keys per
  split window, so a minority class (the few continued conversations on
  Mooncake) is followed in full rather than by a few dozen episodes. With
  F_c(L) the share of a class's episodes reused within L and M_c(L) their
  mean space-time min(d, L), lives L_A and L_B may take
  rate_A M_A(L_A) + rate_B M_B(L_B) <= capacity blocks; the pair with most
  hits rate_A F_A(L_A) + rate_B F_B(L_B) gives the target L_A - L_B, and
  shift moves an eighth of the way there at each split. This sees
  what ghosts cannot: when reuse comes later than the cache's lifetime
  (Mooncake at 1%: minutes between turns), keeping fewer conversations for
  longer pays, and only distances beyond the lifetime say so.
- LRU check: the split's model counts reuses block by block at fixed
  lives, and where that is wrong it shifts at a loss (`convo` at 1%: class
  A is small, the age of its oldest block swings, and hub branches go well
  before their modeled life). So the sampled reuses are also counted by
  whether this cache hit or missed them, against LRU's life (the longest
  both classes fit in at equal lives): a hit beyond it is a gain over LRU,
  a miss within it a loss. The split's target stands only while gains are
  at least GAIN_OVER_LRU times the losses; else shift aims at 0.
- Shadow LRU (version 13): that check is a model too, and on some `convo`
  seeds it passed a shift that lost. So an LRU of keys only runs beside the
  cache on a hash sample of them (SHARDS: 1 in 2**s keys in a capacity
  2**s times smaller, about SIM_BLOCKS keys), and while shift is on, the
  uses of those keys where one of the two hit and the other missed are
  counted (kept about a thousand splits). Where their difference is significant
  (SIM_Z standard deviations of a sign test) it decides: LRU ahead, shift
  aims at 0; the cache ahead, the split's target stands. Else the check
  above decides. Uses while shift is near 0 are not counted: with no shift
  the comparison says nothing about it (on a one-shot workload the cache
  without a shift trails LRU a little and ARC a lot, and counting them
  kept the shift from ever starting).
- Hub: a block once `HUB` requests have branched right after it (their
  stores began there); the count lives while the block is resident.
- Hub heads: the blocks a hub branch request hit (its head: a system prompt
  up to the hub) are kept in a fourth order whose last use counts
  `HEAD_GAIN * max(shift, HEAD_FLOOR)` newer. The split values a head
  block's reuse as one block, but every branch after it needs it: with
  several system prompts at a small cache (`multisys` at 1%) the rarer
  prompts outlived the split's horizon and were lost, and ARC, which keeps
  frequent blocks, won. The floor (version 16) protects a head from the
  moment its hub is known, before the split has learned any shift (on
  `rag`, where popular documents are the heads, the shift stays 0 for a
  third of the trace or more).
- ARC's split of the rest: every store outside a hub branch is loose until
  its first hit (ARC's T1; chain's order is its T2), a continuation too.
  Victims leave ghosts as in ARC: B1 (loose) and B2 (blocks that were hit),
  |loose| + |B1| <= c and all of them <= 2c. A request's first miss on a B1
  ghost raises p, the loose order's target size; on a B2 ghost it lowers p
  (ARC's steps, times P_STEP: a first miss stands for a request; deeper
  misses do not count, as in `chain`; ARC's ratio of the two lists is
  capped at RATIO_MAX). While the loose order holds more than p blocks,
  its oldest go first. p starts at the capacity, so until ghosts say
  otherwise the orders merge by age as before. A B2 ghost stored again
  joins chain's order (a second use of a block that was hit). Where
  frequency pays (`rag`: popular documents read again after they were
  evicted, a question used once after each) this is what ARC keeps. Ties
  between the orders go to the loose one: of one request's blocks stored
  in one step, its new tail goes before its second-use head.
- Hub branches' own target q (version 10): the hub branch order is outside
  p (where hub branches go on within a few requests, `tools`, ARC's T1
  rule for them lost), but where they are mostly used once (`rag`: a
  question after a popular document) they outlived the loose blocks. So
  they have ARC's rule of their own against the blocks that were hit:
  a never-hit hub branch victim leaves a ghost (at most c), a request's
  first miss on one raises q, one on a B2 ghost lowers it (equal steps:
  with ARC's ratio q pinned itself low on `tools`, as p did in version 8).
  While the hub branch order holds more than q blocks, its oldest go
  first. q starts at the capacity.
- A warm-up (version 11): p's and q's steps are WARM_GAIN times larger at
  first, falling to one step over a few thousand first misses. Both start
  at the capacity, a guess; where the workload wants them low (`rag`),
  version 10 got there only halfway through the trace.
- p never falls below P_FLOOR of the capacity (version 12): ARC's ratio
  can pin it near 0, where a chat row lost to LRU.
- A running request's loaded head is held until it finishes (`access`).

Everything else (a store never evicts its own request's keys, a cut store
refuses the rest) is `segchain`'s, without its reuse-interval shield (f
stays 0).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable
from itertools import filterfalse, repeat

import numpy as np

from kvoffload.abstractions import ReqContext
from kvoffload.policies import hubchain_loops as loops
from kvoffload.policies.segchain import SegChainPolicy, _SegReq

BINS = 48  # reuse distances in requests, 4 bins per octave: 1 .. 2^12
HORIZON = 2.0 ** (BINS / 4)  # an episode not reused within this many requests counts as never (at most)
_EDGE = [2.0 ** ((b + 1) / 4) for b in range(BINS)]  # upper distance of each bin
_MID = [(_EDGE[b - 1] if b else 0.0) / 2 + _EDGE[b] / 2 for b in range(BINS)]
A, B = 0, 1  # the classes: the rest, hub branches
_MAX_RATE = 6  # 1 in 64 at most
_WEIGHT = [float(1 << k) for k in range(_MAX_RATE + 1)]  # an episode sampled at 1 in 2**k stands for 2**k
_MAX_SIM_RATE = 8  # the shadow LRU samples 1 in 256 keys at most (one hash byte)
assert _MAX_SIM_RATE < len(loops.SAMPLE_TABLES) and _MAX_RATE < len(loops.SAMPLE_TABLES)
# Uses are followed at each call by hubchain_loops.follow where its C twin is
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


class _HubReq(_SegReq):
    __slots__ = ("hub",)


class _Loaded:
    """The keys a running request loaded: held until it finishes."""

    __slots__ = ("keys",)

    def __init__(self):
        self.keys: set[bytes] = set()


class HubChainPolicy(SegChainPolicy):
    name = "hubchain"
    HUB = 8  # branches seen from a block before it counts as a hub
    TARGET = 512  # keys of each class sampled per split window (about), for reuse distances
    MIN_EPISODES = 50  # per class (weighted by rate), before the split moves from shift 0
    # shift moves this part of the way to each split's target: the targets of
    # successive splits swing (Mooncake's first half at 10%: 300-800 requests),
    # and a steady shift serves more hits than one that follows each (tune rows:
    # 1/8 beat 1/4 and 1/16).
    FOLLOW = 0.125
    # No reuse-interval shield (f stays 0): with 30 agentic conversations at
    # once it refused stores that LRU would have made room for (all 30 at
    # stagger 0, 10%: -0.004 against LRU); the held head, the own-key rule and
    # the cut keep the agentic lead without it (agentic-judge at 1%: 11.7x LRU).
    f_max = 0.0
    # Hub heads live this many shifts longer (multisys seeds 101-108 at 1%,
    # mean against best(LRU, ARC): gain 1 -0.0003, 2 +0.0010, 4 +0.0019; on
    # the table's other rows 2 and 4 choose alike). Version 15: 8, the trend
    # taken one step on: multisys-judge12 at 1% (-0.0020 with 4, -0.0019
    # with 6) gives ARC's rate; on the 354 seen rows 32 rows move (chat,
    # multisys, rag), 24 up, by -0.0014 to +0.0024 (rag-judge9 at 5% -0.0048
    # -> -0.0033, still failing; 12 and 16 no better there). judge16: 24 of
    # 24 (with 4, rag-judge16 at 10% fails, -0.0035).
    HEAD_GAIN = 8.0
    # ... and at least HEAD_FLOOR requests' worth of shift (version 16): with
    # the shift at 0 a head competed by age with blocks used once. Chosen
    # among 0.5, 1, 2, 4 on the eleven seen rag seeds (mean margin at 1%:
    # +0.0093, +0.0106, +0.0129, +0.0158 against +0.0079 with none; at 5%
    # about level, +0.0069 to +0.0081 against +0.0074); 1, the only one with
    # every rag row within 0.002, was then run on all 402 seen rows: none
    # below -0.002 (version 15: rag-judge9 at 5%), 14 below -0.001 (18).
    # judge18: 24 of 24. rag-judge9 at 5% passes at the top of its noise
    # band (docs/BENCHMARKS.md, "Version 16, made the default").
    HEAD_FLOOR = 1.0
    # The split's target stands while the sampled reuses this cache hit beyond
    # LRU's life are at least this many times those it missed within it
    # (_beats_lru); they are remembered with this decay per split. Tuned on
    # the seen convo rows: 1x, or a memory of 0.8 per split, each failed some.
    GAIN_OVER_LRU = 2.0
    CHECK_MEMORY = 0.95
    # The shadow LRU holds about SIM_BLOCKS keys (below twice that capacity,
    # every key: it is then a full LRU); its verdict needs SIM_Z standard
    # deviations; it counts while shift is at least SIM_ON requests. Set
    # before any run (version 13), not tuned.
    SIM_BLOCKS = 2048
    SIM_Z = 2.0
    SIM_ON = 1.0
    # Its counts are kept about a thousand splits (version 14). They grow only
    # while the shift is on, and an "LRU ahead" verdict brings the shift down
    # (an eighth per split: 30 splits from 90 requests to 2). Decayed by 0.95
    # per split (version 13) the verdict faded in about 40, the model check
    # raised the shift again, and it swung: convo-judge14 at 1% found LRU
    # ahead at 264 of 561 splits, the shift back near 90 after each, and
    # lost 0.0035 to LRU (0.0006 with this memory; 0.990 lost 0.0025).
    SIM_MEMORY = 0.999
    # p moves this many blocks (times ARC's ghost ratio) per first miss: a
    # first miss stands for a request's blocks. Chosen on the seen rows
    # (rag-judge7, agentic-tune); after the judge8 run, 8-16 served rag-judge8
    # better but each failed another row (scan-tune at 1% with 16).
    P_STEP = 4.0
    # ARC's ratio of the ghost lists, capped: uncapped, a low p pinned itself
    # (a small loose order leaves room for a long B1, so each B2 ghost moved p
    # down by |B1|/|B2| steps, up to 275 blocks, and B1 ghosts up by one):
    # tools-judge8 at 5% kept p at 0-123 of 1,951 blocks and lost 0.0025 to
    # LRU. Version 9.
    RATIO_MAX = 4.0
    # p's and q's steps are WARM_GAIN times larger at the start, falling as
    # WARM_GAIN / (1 + n / WARM_MISSES) after n first misses to one step (at
    # n = 3,000 here). Both start at the capacity, a guess made before any
    # evidence, and where the workload wants them low (`rag`: p about 0.2c,
    # q about 0) the descent took thousands of requests: rag-judge9 at 5% was
    # still above p = 0.2c at request 2,000 of 3,741. Chosen on the seen rows
    # (version 11): gain 4 over 1,000 first misses fixed three rag rows and
    # broke none (chat-judge11, failing already, lost 0.0006 more).
    WARM_GAIN = 4.0
    WARM_MISSES = 1000
    # p stays at least this share of the capacity (version 12). ARC's ratio
    # pins p near 0 where the loose order is small (B1 then holds up to c
    # ghosts, B2 few): tools-judge8 in version 8, chat-judge11 in version 10
    # (p held at 0 there 0.5750, at 0.05c 0.5784, at 0.1c 0.5791 like LRU).
    # Where p near 0 is right (rag at 1%) the floor gives up part of the
    # gain over ARC, not the lead.
    P_FLOOR = 0.1

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.f = 0.0
        self._hubbed: OrderedDict[bytes, int] = OrderedDict()  # hub branches' blocks, never hit; oldest first
        self._heads: OrderedDict[bytes, int] = OrderedDict()  # hub heads (hit by a hub branch request); oldest first
        self._branches: dict[bytes, int] = {}  # resident key -> requests that branched right after it
        self._recent: OrderedDict[bytes, None] = OrderedDict()  # evicted keys (ARC's ghosts), bounded by capacity
        # ARC's split of the rest: p is the loose order's target size; B1 and
        # B2 are ghosts of loose blocks and of blocks that were hit (chain's
        # order, heads), bounded as ARC bounds them.
        self._p = float(capacity)
        # Hub branches' target q, and the ghosts of hub branch blocks evicted
        # before their first hit (at most c): their first misses raise q.
        self._q = float(capacity)
        self._learned = 0  # first misses so far (the warm-up's clock)
        self._hub_ghosts: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
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
        self._evicted_since = 0
        # Keys running requests loaded (a set: C-level updates), and how many
        # hold a key that more than one holds.
        self._held: set[bytes] = set()
        self._held_more: dict[bytes, int] = {}
        self._loads = object()  # owner of each context's _Loaded (get_owned(self) holds its _HubReq)
        # Uses logged for _drain: the keys in one list, each call's end in it
        # and (clock << 2) | (class << 1) | hit.
        self._log_keys: list[bytes] = []
        self._log_end: list[int] = []
        self._log_meta: list[int] = []
        self._batched = not loops.NATIVE and min(first, self._sim_rate) >= _BATCH_FROM

    # ---- reuse distances ---------------------------------------------------

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
        """_follow at once (hubchain_loops.follow): each followed key ends the
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
        hubchain_loops.shadow, counting while the shift is on."""
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

    # ---- segchain's hooks ----------------------------------------------------

    def _orders(self) -> tuple[OrderedDict, ...]:
        return self._order, self._loose, self._hubbed, self._heads

    def _learn(self, first_miss: bytes) -> None:
        """ARC's adaptation of p, on a request's first miss only (a deeper
        miss is worth nothing once a block before it is gone): a B1 ghost
        says the loose order was too short, a B2 ghost that it was too long.
        q the same way, by equal steps: a hub branch ghost says the hub
        branch order was too short, a B2 ghost (while hub branch ghosts
        exist) that it was too long. (f stays 0: chain's regret ghosts are
        not kept.) Steps are larger early on (WARM_GAIN)."""
        self._learned += 1
        b1, b2, cap = self._b1, self._b2, self.RATIO_MAX
        step = self.P_STEP * max(1.0, self.WARM_GAIN / (1 + self._learned / self.WARM_MISSES))
        hub_ghosts = self._hub_ghosts
        if hub_ghosts:
            if first_miss in hub_ghosts:  # (in neither B1 nor B2)
                del hub_ghosts[first_miss]
                self._q = min(float(self.capacity), self._q + step)
                return
            if first_miss in b2:
                self._q = max(0.0, self._q - step)
        if first_miss in b1:
            self._p = min(float(self.capacity), self._p + step * min(cap, max(1.0, len(b2) / len(b1))))
        elif first_miss in b2:
            self._p = max(self.P_FLOOR * self.capacity, self._p - step * min(cap, max(1.0, len(b1) / len(b2))))

    def _new_req(self, threshold: float) -> _HubReq:
        req = _HubReq(threshold)
        req.hub = False
        return req

    def _branched(self, req: _HubReq, parent: bytes | None) -> None:
        """Count the branch; a request branching off a hub stores hub branch blocks."""
        if parent is not None:
            n = self._branches.get(parent, 0) + 1
            self._branches[parent] = n
            req.hub = n >= self.HUB

    def _pick(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        # can_evict is asked of the whole pick at once (C-level) when the
        # manager offers it: if all may go, the walk that asks of each in
        # turn makes the same choices.
        fast = getattr(can_evict, "all", None)
        if fast is not None:
            victims = self._merge(n, None)
            if len(victims) == n and fast(victims):
                return victims
        return self._merge(n, can_evict)

    def _merge(self, n: int, can_evict: Callable[[bytes], bool] | None) -> list[bytes]:
        """Up to n victims (can_evict None: all may go): hubchain_loops.merge.
        While the hub branch order holds more than q blocks, its oldest go
        first; then while the loose order holds more than p, its oldest
        (ARC's REPLACE); then four orders, each walked from its oldest:
        loose, chain's (stops at its first shielded block), hub branches
        (last use counts `shift` older) and hub heads (HEAD_GAIN *
        max(shift, HEAD_FLOOR) newer). The oldest head goes first; a tie to
        the lower order, so of one request's blocks stored in one step, the
        new ones (loose, its tail) go before the second uses (chain's, its
        head)."""
        shift = self.shift
        return loops.merge(n, self._loose, self._order, self._hubbed, self._heads, self._p, self._q,
                           self._threshold, -shift, self.HEAD_GAIN * max(shift, self.HEAD_FLOOR), self._own or (),
                           self._held, can_evict)

    # ---- the EvictionPolicy contract -------------------------------------

    def insert(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        self._picked = None  # (segchain's insert is not called)
        req = ctx.get_owned(self) if ctx is not None else None
        now = self._clock
        b1, b2, hub_ghosts = self._b1, self._b2, self._hub_ghosts
        if hub_ghosts and not hub_ghosts.keys().isdisjoint(keys):  # stored again: no longer a ghost
            deque(map(hub_ghosts.pop, keys, repeat(None)), 0)
        second = None  # B2 ghosts stored again: a second use of a block that was hit (ARC: to T2)
        if (b1 and not b1.keys().isdisjoint(keys)) or (b2 and not b2.keys().isdisjoint(keys)):
            second = set()
            for k in keys:
                if k in b1:
                    del b1[k]
                elif k in b2:
                    del b2[k]
                    second.add(k)
        if req is not None and req.hub:
            hubbed, order, recent = self._hubbed, self._order, self._recent
            if recent.keys().isdisjoint(keys):
                again = []
                loops.stamp(hubbed, keys, now)  # the tail lands older than the head
            else:
                again = [k for k in keys if k in recent]
                for k in reversed(keys):
                    if k in recent:  # evicted lately and back: a second use (ARC's ghost hit)
                        del recent[k]
                        order[k] = now
                    else:
                        hubbed[k] = now
            if again:
                self._follow(again, A, False)
                promoted = set(again)
                keys = [k for k in keys if k not in promoted]
            self._follow(keys, B, False)
            return
        if req is None:  # (stored outside a request)
            loops.stamp(self._order, keys, now)
        elif second:
            loose, order = self._loose, self._order
            for k in reversed(keys):
                if k in second:
                    order[k] = now
                else:
                    loose[k] = now
        else:  # never hit yet: loose (ARC's T1)
            loops.stamp(self._loose, keys, now)
        self._follow(keys, A, False)

    def insert_cold(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        b1, b2, hub_ghosts = self._b1, self._b2, self._hub_ghosts
        if b1 or b2 or hub_ghosts:  # stored again: no longer a ghost
            for k in keys:
                b1.pop(k, None)
                b2.pop(k, None)
                hub_ghosts.pop(k, None)
        super().insert_cold(keys, ctx)

    def access(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        """A running request loaded these (its head): no other request's
        store evicts them until it finishes (its later stores are its tail:
        a head lost under them makes the whole request unreachable)."""
        self._picked = None
        if ctx is None:
            return
        loaded = ctx.get_owned(self._loads)
        if loaded is None:
            loaded = _Loaded()
            ctx.set_owned(self._loads, loaded)
        held, new = self._held, set(keys)
        if loaded.keys:
            new -= loaded.keys
            loaded.keys |= new
        else:
            loaded.keys = new  # (the common case: one load per request)
        if not held.isdisjoint(new):
            more = self._held_more
            for k in held.intersection(new):  # held by another running request too
                more[k] = more.get(k, 1) + 1
        held |= new

    def _let_go(self, loaded: _Loaded | None) -> None:
        if loaded is None or not loaded.keys:
            return
        held, more, mine = self._held, self._held_more, loaded.keys
        if more:
            for k in more.keys() & mine:  # still held by another
                mine.discard(k)
                if more[k] > 2:
                    more[k] -= 1
                else:
                    del more[k]
        held -= mine
        loaded.keys = set()

    def touch(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        # segchain's touch inlined (a hub branch's keys would go to chain's
        # order there, only to move to the heads here)
        self._picked = None
        req = None
        if ctx is not None:
            self._let_go(ctx.get_owned(self._loads))  # its use is committed (vLLM 0.33: at the finish)
            req = ctx.get_owned(self)
        order, loose, hubbed, heads, now = self._order, self._loose, self._hubbed, self._heads, self._clock
        if req is not None and req.hub:  # a hub branch's head: a hub's path from now on
            if not (heads and loops.renew_all(heads, keys, now)):  # (the common case: all heads already, one C loop)
                if hubbed and not hubbed.keys().isdisjoint(keys):
                    for k in keys:
                        if k in hubbed:  # its first hit: a continued branch
                            del hubbed[k]
                            order[k] = now
                if heads and not heads.keys().isdisjoint(keys):
                    loops.renew(heads, keys, now)
                for k in reversed(keys):
                    if order.pop(k, None) is not None or loose.pop(k, None) is not None:
                        heads[k] = now
        else:
            used = now
            if req is None:
                self._clock = used = now + 1
            # each key to its order's newest end, the head last; a loose or hub
            # branch key's first hit moves it to chain's order (shielded from now on)
            loops.touch(keys, order, loose, heads, hubbed, used, now)
        self._follow(keys, A, True)

    def refresh(self, keys: list[bytes], ctx: ReqContext | None) -> None:
        self._picked = None
        req = None
        if ctx is not None:
            self._let_go(ctx.get_owned(self._loads))  # the request finished
            req = ctx.get_owned(self)
        if req is None:
            self._clock += 1
        now = self._clock
        if req is not None:  # its stores are all in its class's order (unless some came back as ghosts)
            seg = self._hubbed if req.hub else self._loose
            if loops.renew_all(seg, keys, now):
                return  # (a key is in one order only: none of the others holds any)
        for seg in (self._order, self._loose, self._hubbed, self._heads):
            if seg and not seg.keys().isdisjoint(keys) and not loops.renew_all(seg, keys, now):
                loops.renew(seg, keys, now)

    def remove(self, key: bytes) -> None:
        super().remove(key)
        self._held.discard(key)
        self._held_more.pop(key, None)
        self._hubbed.pop(key, None)
        self._heads.pop(key, None)
        self._branches.pop(key, None)

    def _drop(self, victims: list[bytes]) -> None:
        # Each victim to ARC's ghosts and `recent`, then ARC's bounds
        # (hubchain_loops.drop); a split every quarter of the capacity evicted.
        loops.drop(victims, self._order, self._loose, self._hubbed, self._heads, self._b1, self._b2,
                   self._hub_ghosts, self._recent, self._branches, self.capacity)
        self._evicted_since += len(victims)
        if self._evicted_since >= max(1, self.capacity // 4):
            self._evicted_since = 0
            self._split()
            self._sim_ours *= self.SIM_MEMORY  # (at every split, the first ones too)
            self._sim_lru *= self.SIM_MEMORY

    def __len__(self) -> int:
        return len(self._order) + len(self._loose) + len(self._hubbed) + len(self._heads)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._loose or key in self._hubbed or key in self._heads

