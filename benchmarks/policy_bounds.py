"""How far can an online eviction policy get on a conversation trace?

Issue #9 asks for half of the LRU -> OPT gap in prefix hit rate. This script
measures what the information a prefix cache sees could buy, with bounds
that are *more* generous than any online policy:

- lru, opt: the reference points (the replay oracles).
- perfect admission: an oracle stores only blocks that will be used again
  and drops each after its last use; eviction is LRU. This is perfect
  dead-block prediction, the whole of OPT's advantage when the live set fits.
- hindsight density: a hit-density policy (rank = P(still alive | class,
  age) / mean residual gap, lowest evicted, 64 sampled candidates, a
  request's last partial block treated as dead) whose per-class statistics
  are computed from the *whole trace in advance*. Classes are what a cache
  could know when it stores a request: turn depth in its conversation,
  prompt length, the previous turn's gap and the output length. An online
  policy has to learn these statistics, so it can only do worse.
- AUC: how well those classes separate requests that get a follow-up turn
  from those that never do (0.5 = coin toss), in-sample.
- noisy admission: what a better predictor would buy. Each request gets a
  score N(mu * continues, 1), so the predictor's AUC is Phi(mu / sqrt 2);
  requests scored below a threshold (best of a few) and every request's
  last partial block go to LRU's old end. LRU otherwise.

A request's parent is the latest earlier request that held its deepest
matched block, when at least two leading blocks match (block 0 is a shared
system prompt on Mooncake). Ages are trace seconds.

    .venv/bin/python benchmarks/policy_bounds.py                  # 1%, 5%, 10% of the shared trace
    .venv/bin/python benchmarks/policy_bounds.py --fractions 0.05 --trace my.jsonl
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import statistics
from collections import OrderedDict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvoffload.replay.oracle import leading_run, simulate_belady, simulate_lru
from kvoffload.replay.traces import load_trace
from shared_traces import shared_trace_path

NEVER = 1 << 62
AGE_STEP = 5.0  # seconds per age bin of the density table
AGE_BINS = 1600


def conversation_tree(blocks: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """parent[i] (-1 if none) and depth[i] of every request."""
    last: dict[int, int] = {}
    parent = np.full(len(blocks), -1)
    depth = np.zeros(len(blocks), dtype=int)
    for i, h in enumerate(blocks):
        m = leading_run(h, last)
        if m >= 2:
            parent[i] = last[h[m - 1]]
            depth[i] = depth[parent[i]] + 1
        for b in h:
            last[b] = i
    return parent, depth


def classes(trace, parent: np.ndarray, depth: np.ndarray) -> np.ndarray:
    t = np.array([r.arrival_ms for r in trace.requests]) / 1000
    prev_gap = np.where(parent >= 0, t - t[np.maximum(parent, 0)], -1.0)
    d = np.minimum(depth, 4)
    long_prompt = np.array([r.prompt_tokens >= 2000 for r in trace.requests], dtype=int)
    g = np.digitize(prev_gap, [0, 60, 240])  # none, <60 s, <240 s, longer
    out = np.digitize([r.output_tokens for r in trace.requests], [100, 400])
    return ((d * 2 + long_prompt) * 4 + g) * 3 + out


def auc(score: np.ndarray, label: np.ndarray) -> float:
    rank = np.empty(len(score))
    order = np.lexsort((np.random.default_rng(0).random(len(score)), score))
    rank[order] = np.arange(1, len(score) + 1)
    pos = label.sum()
    return float((rank[label].sum() - pos * (pos + 1) / 2) / (pos * (len(score) - pos)))


def perfect_admission(blocks: list[list[int]], capacity: int) -> float:
    nxt: dict[int, int] = {}
    future: list[list[int]] = [[] for _ in blocks]
    for i in range(len(blocks) - 1, -1, -1):
        future[i] = [nxt.get(b, NEVER) for b in blocks[i]]
        for b in blocks[i]:
            nxt[b] = i
    order: OrderedDict[int, None] = OrderedDict()
    hits = refs = 0
    for i, h in enumerate(blocks):
        hits += leading_run(h, order)
        refs += len(h)
        for b, n in zip(reversed(h), reversed(future[i])):  # tail first: the tail ends older
            if n == NEVER:
                order.pop(b, None)
            elif b in order:
                order.move_to_end(b)
            else:
                order[b] = None
        while len(order) > capacity:
            order.popitem(last=False)
    return hits / refs


def noisy_admission(blocks, has_child: np.ndarray, target_auc: float, capacity: int) -> float:
    mu = 2 ** 0.5 * statistics.NormalDist().inv_cdf(target_auc)
    score = np.random.default_rng(0).normal(size=len(blocks)) + mu * has_child
    best = 0.0
    for threshold in (-9.0, 0.0, 0.5, 1.0, 1.5):  # -9: demote only the last blocks
        live = score > threshold
        order: OrderedDict[int, None] = OrderedDict()
        hits = refs = 0
        for i, h in enumerate(blocks):
            hits += leading_run(h, order)
            refs += len(h)
            last = len(h) - 1
            for j in range(last, -1, -1):  # tail first
                b = h[j]
                if b in order:
                    order.move_to_end(b)
                else:
                    order[b] = None
                if j and (j == last or not live[i]):
                    order.move_to_end(b, last=False)  # predicted dead: evicted first
            while len(order) > capacity:
                order.popitem(last=False)
        best = max(best, hits / refs)
    return best


def density_table(cls: np.ndarray, parent: np.ndarray, t: np.ndarray) -> np.ndarray:
    """density[c, age bin] = P(alive | c, age) / E[gap - age | gap > age]."""
    child = np.full(len(parent), -1)
    child[parent[parent >= 0]] = np.nonzero(parent >= 0)[0]
    ages = np.arange(AGE_BINS) * AGE_STEP
    table = np.zeros((int(cls.max()) + 1, AGE_BINS))
    for c in np.unique(cls):
        sel = cls == c
        cont = child[sel] >= 0
        p_cont = cont.mean()
        gaps = np.sort(t[child[sel][cont]] - t[sel][cont])
        if not len(gaps):
            continue
        tail_sum = np.concatenate([np.cumsum(gaps[::-1])[::-1], [0.0]])
        for k, a in enumerate(ages):
            j = bisect.bisect_right(gaps, a)
            alive_n = len(gaps) - j
            if alive_n == 0:
                break
            s = alive_n / len(gaps)
            alive = p_cont * s / (1 - p_cont + p_cont * s)
            residual = tail_sum[j] / alive_n - a
            table[c, k] = alive / max(residual, 1.0)
    return table


def hindsight_density(blocks, t, cls, table, capacity: int, samples: int = 64) -> float:
    rng = random.Random(0)
    info: dict[int, tuple[float, int, int]] = {}  # block -> (last use s, class or -1 dead, position)
    keys: list[int] = []
    where: dict[int, int] = {}
    hits = refs = 0
    for i, h in enumerate(blocks):
        hits += leading_run(h, info)
        refs += len(h)
        now = t[i]
        for j, b in enumerate(h):
            if b not in info:
                where[b] = len(keys)
                keys.append(b)
            info[b] = (now, -1 if 0 < j == len(h) - 1 else int(cls[i]), j)
        mine = set(h)
        while len(keys) > capacity:
            best, best_rank = None, None
            for _ in range(samples):
                k = keys[rng.randrange(len(keys))]
                if k in mine:
                    continue
                last, c, j = info[k]
                d = -1.0 if c < 0 else table[c, min(int((now - last) / AGE_STEP), AGE_BINS - 1)]
                if best_rank is None or (d, -j) < best_rank:
                    best, best_rank = k, (d, -j)  # tail first among equals
            if best is None:
                continue
            p = where.pop(best)
            tail = keys.pop()
            if tail != best:
                keys[p] = tail
                where[tail] = p
            del info[best]
    return hits / refs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=None, help="trace path (default: the shared Mooncake trace)")
    ap.add_argument("--fractions", default="0.01,0.05,0.10", help="capacities as shares of the unique blocks")
    ap.add_argument("--aucs", default="0.66,0.85,0.95",
                    help="predictor AUCs for the noisy-admission rows ('' to skip)")
    ap.add_argument("--out", default="out/policy_bounds.json")
    args = ap.parse_args(argv)
    trace = load_trace(args.trace or shared_trace_path())
    blocks = [r.block_hashes for r in trace.requests]
    t = np.array([r.arrival_ms for r in trace.requests]) / 1000
    unique = len({b for h in blocks for b in h})
    parent, depth = conversation_tree(blocks)
    cls = classes(trace, parent, depth)
    has_child = np.zeros(len(blocks), dtype=bool)
    has_child[parent[parent >= 0]] = True
    p_cont = {c: has_child[cls == c].mean() for c in np.unique(cls)}
    a = auc(np.array([p_cont[c] for c in cls]), has_child)
    table = density_table(cls, parent, t)
    print(f"{trace.name}: {len(blocks)} requests, {unique} unique blocks; "
          f"{has_child.mean():.2f} of requests get a follow-up turn; AUC of the classes for it: {a:.3f}")
    rows = []
    for f in tqdm([float(x) for x in args.fractions.split(",")], desc="capacities"):
        cap = max(1, int(unique * f))
        lru = simulate_lru(blocks, cap).hit_rate
        opt = simulate_belady(blocks, cap).hit_rate
        rows.append({"fraction": f, "blocks": cap, "lru": lru, "opt": opt, "goal": (lru + opt) / 2,
                     "perfect_admission": perfect_admission(blocks, cap),
                     "hindsight_density": hindsight_density(blocks, t, cls, table, cap),
                     "noisy_admission": {x: noisy_admission(blocks, has_child, float(x), cap)
                                         for x in args.aucs.split(",") if x}})
    aucs = list(rows[0]["noisy_admission"]) if rows else []
    print(f"{'capacity':>8} {'lru':>7} {'hindsight':>9} " + "".join(f"{'auc ' + x:>9}" for x in aucs)
          + f" {'perf.adm':>8} {'goal':>7} {'opt':>7}")
    for r in rows:
        print(f"{r['fraction']:>8.0%} {r['lru']:7.4f} {r['hindsight_density']:9.4f} "
              + "".join(f"{r['noisy_admission'][x]:9.4f}" for x in aucs)
              + f" {r['perfect_admission']:8.4f} {r['goal']:7.4f} {r['opt']:7.4f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"trace": trace.name, "auc": a, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
