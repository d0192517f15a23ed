"""Eviction policies x workloads x capacities through the real CPU manager.

A fast stand-in for `kvoffload replay` (no byte copies, no engine): per
request, in arrival order, lookups up to the first miss, load of the hits,
stores of the rest of the prompt in batches of --step-blocks (then the
decode blocks), each completed at once, then on_request_finished (where the
manager commits recency, as vLLM 0.33 does). Every key's end-token position
is set on the request context, as vLLM's connector does. Belady (offline
optimum) at the same capacity is the yardstick.

Workloads (TUNE / JUDGE split: docs/design/hubchain.md):
  agentic-tune    trace_0318..0329 (12 conversations), 60 s stagger
  agentic-judge   trace_0300..0311 (12 conversations: issue 17's setting)
  agentic-rest    trace_0312..0317
  agentic-all     all 30, 60 s stagger; agentic-all-s0 / -s600: stagger 0 / 600 s
  chat-tune       generated chat, seed 0, 2000 sessions;  chat-judge: seed 1
  mooncake        the Mooncake conversation trace
  scan            a hot set of chat sessions cut by one long scan of never-reused blocks
  oneshot         many short one-shot prompts (shared 4-block preamble) among chat sessions
  systail         one shared system prompt, a long tail of users with 1-3 turns each
  scan-tune, oneshot-tune   the same kinds, other seeds and sizes (tuning data for segchain)
  convo-tune      Mooncake-like: a shared system block, conversations that mostly end after a turn (tuning, duel)
  mooncake-first / mooncake-second   the first / second half of the Mooncake trace, each replayed from an
                  empty cache (hubchain: tuned on the first, judged on the second)
  chat-judge2, scan-judge2, oneshot-judge2, systail-judge2, convo-judge2   fresh seeds of the built rows
                  (hubchain's judge run; never looked at before it)
  chat-judge3, scan-judge3, oneshot-judge3, systail-judge3, convo-judge3   fresh seeds again (hubchain's
                  second judge run, after the smoothed split)
  chat-judge4, scan-judge4, oneshot-judge4, systail-judge4, convo-judge4, multisys-judge4   fresh seeds for
                  hubchain's version 4, and a kind built for it (multisys: several system prompts, Mooncake-like turns)
  chat-judge5, scan-judge5, oneshot-judge5, systail-judge5, convo-judge5, multisys-judge5   fresh seeds for
                  hubchain's version 5
  chat-judge6, scan-judge6, oneshot-judge6, systail-judge6, convo-judge6, multisys-judge6, tools-judge6
                  fresh seeds for hubchain's version 6, and a kind added with them (tools: agent loops behind
                  a few long tool schemas, many short turns close together)
  chat-judge7, scan-judge7, oneshot-judge7, systail-judge7, convo-judge7, multisys-judge7, tools-judge7,
  rag-judge7      fresh seeds for hubchain's version 7, and a kind added with them (rag: Zipf-popular
                  documents as prefixes, a question after each, some conversations going on)
  chat-judge8, scan-judge8, oneshot-judge8, systail-judge8, convo-judge8, multisys-judge8, tools-judge8,
  rag-judge8      fresh seeds for hubchain's version 8 (first used to judge version 7 again)
  chat-judge9, scan-judge9, oneshot-judge9, systail-judge9, convo-judge9, multisys-judge9, tools-judge9,
  rag-judge9      fresh seeds for hubchain's version 8
  chat-judge10, scan-judge10, oneshot-judge10, systail-judge10, convo-judge10, multisys-judge10,
  tools-judge10, rag-judge10   fresh seeds for hubchain's version 9
  chat-judge11, scan-judge11, oneshot-judge11, systail-judge11, convo-judge11, multisys-judge11,
  tools-judge11, rag-judge11   fresh seeds for hubchain's version 10
  chat-judge12, scan-judge12, oneshot-judge12, systail-judge12, convo-judge12, multisys-judge12,
  tools-judge12, rag-judge12   fresh seeds for hubchain's version 11
  chat-judge13, scan-judge13, oneshot-judge13, systail-judge13, convo-judge13, multisys-judge13,
  tools-judge13, rag-judge13   fresh seeds for hubchain's version 12
  chat-judge14, scan-judge14, oneshot-judge14, systail-judge14, convo-judge14, multisys-judge14,
  tools-judge14, rag-judge14   fresh seeds for hubchain's version 13
  chat-judge15, scan-judge15, oneshot-judge15, systail-judge15, convo-judge15, multisys-judge15,
  tools-judge15, rag-judge15   fresh seeds for hubchain's version 14
  chat-judge16, scan-judge16, oneshot-judge16, systail-judge16, convo-judge16, multisys-judge16,
  tools-judge16, rag-judge16   fresh seeds for hubchain's version 15
  chat-judge17, scan-judge17, oneshot-judge17, systail-judge17, convo-judge17, multisys-judge17,
  tools-judge17, rag-judge17   fresh seeds; used to judge hubchain's version 15 a second time
  chat-judge18, scan-judge18, oneshot-judge18, systail-judge18, convo-judge18, multisys-judge18,
  tools-judge18, rag-judge18   fresh seeds; used to judge hubchain's version 16 (made the default)
  chat-judge19, scan-judge19, oneshot-judge19, systail-judge19, convo-judge19, multisys-judge19,
  tools-judge19, rag-judge19   fresh seeds for hubchain's next version (no run on them yet)

    .venv/bin/python benchmarks/policy_workloads.py --workloads agentic-judge --sweep 1% --policies lru hubchain
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np


ROOT = Path(__file__).resolve().parent.parent
TRACES = Path(os.environ.get("KVOFFLOAD_TRACES", ROOT.parent / "shared" / "traces"))
AGENTIC = TRACES / "agentic"

# A request: (prompt keys, decode keys), prefix order.
Req = tuple[list[bytes], list[bytes]]


def _key(h: int) -> bytes:
    return (h & (2**64 - 1)).to_bytes(8, "big") + b"\0\0\0\0"


class _Ids:
    def __init__(self):
        self.n = 1 << 40

    def take(self, k: int) -> list[bytes]:
        self.n += k
        return [_key(self.n - k + i) for i in range(k)]


def _sessions(rng, ids: _Ids, n: int, sys_blocks: list[bytes] | None = None, turns=(1, 8),
              grow=(1, 8)) -> list[list[list[bytes]]]:
    out = []
    for _ in range(n):
        ctx = list(sys_blocks) if sys_blocks is not None else ids.take(int(rng.integers(4, 40)))
        turns_ = []
        for _ in range(int(rng.integers(turns[0], turns[1] + 1))):
            ctx = ctx + ids.take(int(rng.integers(grow[0], grow[1] + 1)))
            turns_.append(ctx)
        out.append(turns_)
    return out


def _interleave(rng, sessions: list[list[list[bytes]]], gap: float = 40.0) -> list[Req]:
    """Sessions start one per time unit; turns follow after exponential gaps."""
    events = []
    for s, turns in enumerate(sessions):
        t = float(s)
        for prompt in turns:
            events.append((t, s, prompt))
            t += float(rng.exponential(gap))
    events.sort(key=lambda e: (e[0], e[1]))
    return [(p, []) for _, _, p in events]


def scan(seed: int = 11, sessions: int = 1500, scan_reqs: int = 400) -> list[Req]:
    rng, ids = np.random.default_rng(seed), _Ids()
    reqs = _interleave(rng, _sessions(rng, ids, sessions))
    cut = len(reqs) // 2
    long_scan = [(ids.take(64), []) for _ in range(scan_reqs)]  # read once, 64 blocks per request
    return reqs[:cut] + long_scan + reqs[cut:]


def oneshot(seed: int = 12, sessions: int = 800, per: int = 3) -> list[Req]:
    rng, ids = np.random.default_rng(seed), _Ids()
    pre = ids.take(4)
    reqs = _interleave(rng, _sessions(rng, ids, sessions))
    out: list[Req] = []
    for r in reqs:
        out.append(r)
        for _ in range(per):
            out.append((pre + ids.take(int(rng.integers(1, 12))), []))
    return out


def systail(seed: int = 13) -> list[Req]:
    rng, ids = np.random.default_rng(seed), _Ids()
    system = ids.take(48)
    return _interleave(rng, _sessions(rng, ids, 4000, sys_blocks=system, turns=(1, 3), grow=(2, 16)))


def _goes_on(rng, ids: _Ids, ctx: list[bytes]) -> list[list[bytes]]:
    """A conversation's turns from its first prompt: each goes on with a
    probability growing with its depth (0.3 after the first turn, most end there)."""
    turns = [ctx]
    while rng.random() < min(0.8, 0.24 + 0.06 * len(turns)) and len(turns) < 30:
        ctx = ctx + ids.take(int(rng.integers(1, 6)))
        turns.append(ctx)
    return turns


def convo(seed: int = 31, sessions: int = 3000) -> list[Req]:
    """Mooncake-like (built, not taken from the trace): one shared system block,
    conversations that mostly end after a turn, turns far apart."""
    rng, ids = np.random.default_rng(seed), _Ids()
    system = ids.take(1)
    out = [_goes_on(rng, ids, system + ids.take(int(rng.integers(1, 24)))) for _ in range(sessions)]
    return _interleave(rng, out, gap=300.0)


def multisys(seed: int = 71, sessions: int = 3000, prompts: int = 8) -> list[Req]:
    """Several system prompts (2-20 blocks, Zipf-popular), each a hub;
    conversations after them go on as in `convo` (most end after a turn)."""
    rng, ids = np.random.default_rng(seed), _Ids()
    systems = [ids.take(int(rng.integers(2, 21))) for _ in range(prompts)]
    return _after_popular(rng, ids, systems, sessions, (1, 24), gap=300.0)


def tools(seed: int = 96, sessions: int = 1500, schemas: int = 3) -> list[Req]:
    """Agent loops behind a few long tool schemas (30-60 blocks each): a
    session runs 2-20 short turns (a tool call and its result) close together."""
    rng, ids = np.random.default_rng(seed), _Ids()
    heads = [ids.take(int(rng.integers(30, 61))) for _ in range(schemas)]
    out = []
    for _ in range(sessions):
        ctx = heads[int(rng.integers(schemas))] + ids.take(int(rng.integers(2, 12)))
        turns = [ctx]
        for _ in range(int(rng.integers(1, 20))):
            ctx = ctx + ids.take(int(rng.integers(1, 4)))
            turns.append(ctx)
        out.append(turns)
    return _interleave(rng, out, gap=15.0)


def rag(seed: int = 117, sessions: int = 2500, docs: int = 300) -> list[Req]:
    """Retrieval-augmented prompts: a document (4-40 blocks, Zipf-popular) as
    the prefix, a short question after it; some go on as conversations."""
    rng, ids = np.random.default_rng(seed), _Ids()
    corpus = [ids.take(int(rng.integers(4, 41))) for _ in range(docs)]
    return _after_popular(rng, ids, corpus, sessions, (1, 4), gap=40.0)


def _after_popular(rng, ids: _Ids, prefixes: list[list[bytes]], sessions: int, tail: tuple[int, int],
                   gap: float) -> list[Req]:
    """Conversations after Zipf-popular prefixes (the r-th drawn with weight
    1/r): each starts with one and `tail` new blocks, and goes on as in `convo`."""
    weights = 1.0 / np.arange(1, len(prefixes) + 1)
    weights /= weights.sum()
    out = [_goes_on(rng, ids, prefixes[int(rng.choice(len(prefixes), p=weights))] + ids.take(int(rng.integers(*tail))))
           for _ in range(sessions)]
    return _interleave(rng, out, gap=gap)


WORKLOADS = ["agentic-tune", "agentic-judge", "agentic-rest", "agentic-all", "agentic-all-s0", "agentic-all-s600",
             "chat-tune", "chat-judge", "mooncake", "scan", "oneshot", "systail",
             "scan-tune", "oneshot-tune", "convo-tune", "mooncake-first", "mooncake-second",
             "chat-judge2", "scan-judge2", "oneshot-judge2", "systail-judge2", "convo-judge2",
             "chat-judge3", "scan-judge3", "oneshot-judge3", "systail-judge3", "convo-judge3",
             "chat-judge4", "scan-judge4", "oneshot-judge4", "systail-judge4", "convo-judge4", "multisys-judge4",
             "chat-judge5", "scan-judge5", "oneshot-judge5", "systail-judge5", "convo-judge5", "multisys-judge5",
             "chat-judge6", "scan-judge6", "oneshot-judge6", "systail-judge6", "convo-judge6", "multisys-judge6",
             "tools-judge6",
             "chat-judge7", "scan-judge7", "oneshot-judge7", "systail-judge7", "convo-judge7", "multisys-judge7",
             "tools-judge7", "rag-judge7"]
# From judge8 on, each judge set has every kind, with seeds base + 1 .. base + 7 (chat: the set's number).
KINDS = ("chat", "scan", "oneshot", "systail", "convo", "multisys", "tools", "rag")
JUDGE_SETS = {8: 120, 9: 130, 10: 140, 11: 150, 12: 160, 13: 170, 14: 180, 15: 190, 16: 200, 17: 210,
              18: 220, 19: 230}  # set -> seed base
WORKLOADS += [f"{kind}-judge{n}" for n in JUDGE_SETS for kind in KINDS]


def write_jsonl(reqs: list[Req], path: Path, gap_ms: float = 100.0) -> None:
    """Mooncake-format JSONL (hash_ids, 512-token blocks) that `kvoffload replay` reads."""
    with open(path, "w") as f:
        for i, (prompt, _) in enumerate(reqs):
            ids = [int.from_bytes(k[:8], "big") for k in prompt]
            f.write(json.dumps({"timestamp": round(i * gap_ms), "input_length": 512 * len(ids),
                                "output_length": 1, "hash_ids": ids}) + "\n")


GENERATED = {"scan": scan, "oneshot": oneshot, "systail": systail,
             # tuning variants for segchain (other seeds and sizes than the judge rows)
             "scan-tune": lambda: scan(21, 1000, 250), "oneshot-tune": lambda: oneshot(22, 600, 2),
             "convo-tune": convo,  # Mooncake-like tuning row for duel (the trace itself is judge data)
             # hubchain's judge rows: fresh seeds
             "scan-judge2": lambda: scan(41, 1500, 400), "oneshot-judge2": lambda: oneshot(42, 800, 3),
             "systail-judge2": lambda: systail(43), "convo-judge2": lambda: convo(44),
             "scan-judge3": lambda: scan(51, 1500, 400), "oneshot-judge3": lambda: oneshot(52, 800, 3),
             "systail-judge3": lambda: systail(53), "convo-judge3": lambda: convo(54),
             "scan-judge4": lambda: scan(61, 1500, 400), "oneshot-judge4": lambda: oneshot(62, 800, 3),
             "systail-judge4": lambda: systail(63), "convo-judge4": lambda: convo(64),
             "multisys-judge4": lambda: multisys(65),
             "scan-judge5": lambda: scan(81, 1500, 400), "oneshot-judge5": lambda: oneshot(82, 800, 3),
             "systail-judge5": lambda: systail(83), "convo-judge5": lambda: convo(84),
             "multisys-judge5": lambda: multisys(85),
             "scan-judge6": lambda: scan(91, 1500, 400), "oneshot-judge6": lambda: oneshot(92, 800, 3),
             "systail-judge6": lambda: systail(93), "convo-judge6": lambda: convo(94),
             "multisys-judge6": lambda: multisys(95), "tools-judge6": lambda: tools(96),
             "scan-judge7": lambda: scan(111, 1500, 400), "oneshot-judge7": lambda: oneshot(112, 800, 3),
             "systail-judge7": lambda: systail(113), "convo-judge7": lambda: convo(114),
             "multisys-judge7": lambda: multisys(115), "tools-judge7": lambda: tools(116), "rag-judge7": rag}


def _judge_set(base: int) -> dict[str, Callable[[], list[Req]]]:
    """A judge set's generated rows by kind (chat is the replay's own generator)."""
    return {"scan": lambda: scan(base + 1, 1500, 400), "oneshot": lambda: oneshot(base + 2, 800, 3),
            "systail": lambda: systail(base + 3), "convo": lambda: convo(base + 4),
            "multisys": lambda: multisys(base + 5), "tools": lambda: tools(base + 6), "rag": lambda: rag(base + 7)}


GENERATED.update({f"{kind}-judge{n}": make
                  for n, base in JUDGE_SETS.items() for kind, make in _judge_set(base).items()})


def replay_args(name: str, out_dir: Path) -> list[str]:
    """The `kvoffload replay` workload arguments of a table row."""
    if name.startswith("agentic-"):
        part, _, stagger = name[len("agentic-"):].partition("-s")
        first, last = {"tune": (318, 329), "judge": (300, 311), "rest": (312, 317), "all": (300, 329)}[part]
        d = out_dir / f"agentic_{first}_{last}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(first, last + 1):
            link = d / f"trace_{i:04d}.json"
            if not link.exists():
                os.symlink(AGENTIC / link.name, link)
        return [str(d), "--stagger", stagger or "60"]
    if name.startswith("chat-"):
        seeds = {"chat-tune": "0", "chat-judge": "1", "chat-judge2": "2", "chat-judge3": "3", "chat-judge4": "4",
                 "chat-judge5": "5", "chat-judge6": "6", "chat-judge7": "7"}
        seeds.update((f"chat-judge{n}", str(n)) for n in JUDGE_SETS)
        return ["--sessions", "2000", "--seed", seeds[name]]
    if name == "mooncake":
        return [str(TRACES / "mooncake_conversation_trace.jsonl")]
    if name.startswith("mooncake-"):
        path = out_dir / f"{name}.jsonl"
        if not path.exists():
            lines = (TRACES / "mooncake_conversation_trace.jsonl").read_text().splitlines(keepends=True)
            half = len(lines) // 2
            path.write_text("".join(lines[:half] if name == "mooncake-first" else lines[half:]))
        return [str(path)]
    path = out_dir / f"{name}.jsonl"
    if not path.exists():
        write_jsonl(GENERATED[name](), path)
    return [str(path)]


TUNE = ("agentic-tune", "chat-tune", "scan-tune", "oneshot-tune", "convo-tune", "mooncake-first")


def _rows(out_dir: Path, workloads: list[str], candidate: str):
    """(workload, capacity in blocks, prefix hit rate per policy, the run with
    the oracles) per workload and capacity that lru, arc and the candidate all ran."""
    for w in workloads:
        runs = {}
        for p in ("lru", "arc", candidate):
            f = out_dir / f"{w}__{p}.json"
            if f.exists():
                runs[p] = [r["summary"] for r in json.loads(f.read_text())]
        if len(runs) < 3:
            continue
        for i, lru in enumerate(runs["lru"]):
            rate = {p: runs[p][i]["offload_prefix_hit_rate"] for p in runs}
            oracle = next((r[i] for r in runs.values() if "oracle:belady" in r[i]), None)
            yield w, lru["tiers"]["cpu"]["capacity_blocks"], rate, oracle


def table(out_dir: Path, workloads: list[str], candidate: str = "hubchain") -> str:
    """Markdown: per workload and capacity, LRU, ARC, the candidate, the offline
    LRU and Belady, and the candidate's distance from the best of LRU and ARC."""
    lines = [f"| workload | split | blocks | LRU | ARC | {candidate} | offline LRU | Belady | "
             f"{candidate} - best(LRU, ARC) | within 0.002 |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for w, blocks, rate, oracle in _rows(out_dir, workloads, candidate):
        diff = rate[candidate] - max(rate["lru"], rate["arc"])
        lines.append(f"| {w} | {'TUNE' if w in TUNE else 'JUDGE'} | {blocks:,} | "
                     f"{rate['lru']:.4f} | {rate['arc']:.4f} | {rate[candidate]:.4f} | {oracle['oracle:lru']:.4f} | "
                     f"{oracle['oracle:belady']:.4f} | {diff:+.4f} | {'yes' if diff >= -0.002 else '**no**'} |")
    return "\n".join(lines)


def plot(out_dir: Path, workloads: list[str], candidate: str, path: Path) -> None:
    """A bar per workload and capacity: the candidate's prefix hit rate less
    the best of LRU and ARC, with the +-0.002 band of the rule."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, diffs = [], []
    for w, blocks, rate, _ in _rows(out_dir, workloads, candidate):
        diffs.append(rate[candidate] - max(rate["lru"], rate["arc"]))
        labels.append(f"{w} ({blocks:,})")
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(labels) + 1.2))
    ax.barh(range(len(labels)), diffs, color=["tab:green" if d >= -0.002 else "tab:red" for d in diffs])
    ax.axvspan(-0.002, 0.002, color="0.85", zorder=0)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("symlog", linthresh=0.01)
    ax.set_xlabel(f"{candidate} prefix hit rate - best(LRU, ARC)  (grey: within 0.002)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--sweep", default="1%,5%,10%")
    ap.add_argument("--policies", nargs="+", default=["lru", "arc", "hubchain"])
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "policy_workloads")
    ap.add_argument("--table", action="store_true", help="only print the Markdown table of the runs in --out")
    ap.add_argument("--plot", type=Path, help="with --table: also draw the last policy against best(LRU, ARC) (PNG)")
    args = ap.parse_args(argv)
    if args.table:
        print(table(args.out, args.workloads, args.policies[-1]))
        if args.plot:
            plot(args.out, args.workloads, args.policies[-1], args.plot)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    for w in args.workloads:
        for p in args.policies:
            dest = args.out / f"{w}__{p}.json"
            cmd = [sys.executable, "-m", "kvoffload.cli", "replay", *replay_args(w, args.out), "--sweep",
                   args.sweep, "--policy", p, "--no-progress", "--json", str(dest)]
            if p == args.policies[0]:
                cmd.append("--oracle")
            t0 = time.time()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            rates = [r["summary"]["offload_prefix_hit_rate"] for r in json.loads(dest.read_text())]
            print(f"{w:18s} {p:6s} " + " ".join(f"{x:.4f}" for x in rates) + f"  ({time.time() - t0:.0f} s)",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
