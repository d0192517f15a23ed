"""How fast `kvoffload replay` runs, per block reference: two source trees
(e.g. before and after a change) replayed alternately, back to back, on the
same trace, `--repeats` times each; medians and the ratio between them.

    git archive <old-commit> src | tar -x -C /tmp/before
    .venv/bin/python benchmarks/bench_replay_speed.py TRACE --trees /tmp/before/src src --repeats 3
    .venv/bin/python benchmarks/bench_replay_speed.py TRACE --trees src src --tree-args "" "--verify all"

Each run is `kvoffload replay TRACE --no-progress --json ...` (plus
`--args`) in a fresh process with PYTHONPATH set to the tree. Reported from
the replay's own JSON: wall and CPU seconds of the replay (trace loading
excluded), block references per wall second, the manager's, worker's and
harness's shares of the wall time; and the whole process's wall time.
On a shared machine, alternate and take medians: the ratio is the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_once(tree: str, trace: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        js = Path(d) / "r.json"
        env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
        cmd = [sys.executable, "-m", "kvoffload.cli", "replay", trace, "--no-progress", "--json", str(js), *extra]
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, cwd=d)
        process_s = time.perf_counter() - t0
        s = json.loads(js.read_text())["summary"]
    s["process_s"] = process_s
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--trees", nargs="+", required=True, help="source trees (directories holding kvoffload/)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--args", default="", help="more `kvoffload replay` options, e.g. '--cpu-blocks 5%%'")
    ap.add_argument("--tree-args", nargs="+", metavar="ARGS",
                    help="options of each tree's runs, in the order of --trees (e.g. '' '--verify all': "
                         "one tree, two ways)")
    args = ap.parse_args()
    extra = shlex.split(args.args)
    per_tree = args.tree_args or [""] * len(args.trees)
    if len(per_tree) != len(args.trees):
        ap.error("--tree-args needs one entry per tree")
    names = [f"{t} {a}".strip() for t, a in zip(args.trees, per_tree)]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for i in range(args.repeats):
        for t, a, name in zip(args.trees, per_tree, names):
            s = run_once(t, args.trace, extra + shlex.split(a))
            runs[name].append(s)
            print(f"run {i + 1} {name}: wall {s['wall_s']:.2f} s, CPU {s['cpu_s']:.2f} s, "
                  f"{s['block_refs'] / s['wall_s']:,.0f} refs/s, hit rate {s['offload_prefix_hit_rate']:.4f}",
                  file=sys.stderr)
    med = {}
    print("| tree | block refs | wall s | CPU s | refs / wall s | refs / CPU s | manager | worker | harness | "
          "process s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t, rs in runs.items():
        m = {k: statistics.median(r[k] for r in rs)
             for k in ("wall_s", "cpu_s", "manager_s", "worker_s", "harness_s", "process_s")}
        refs = rs[0]["block_refs"]
        med[t] = m | {"refs": refs}
        print(f"| {t} | {refs:,} | {m['wall_s']:.2f} | {m['cpu_s']:.2f} | {refs / m['wall_s']:,.0f} | "
              f"{refs / m['cpu_s']:,.0f} | {m['manager_s'] / m['wall_s']:.0%} | {m['worker_s'] / m['wall_s']:.0%} | "
              f"{m['harness_s'] / m['wall_s']:.0%} | {m['process_s']:.1f} |")
    if len(names) >= 2:
        a, b = (med[n] for n in names[:2])
        print(f"\n{names[1]} vs {names[0]}, per block reference: wall {a['wall_s'] / a['refs'] * b['refs'] / b['wall_s']:.2f}x "
              f"faster, CPU {a['cpu_s'] / a['refs'] * b['refs'] / b['cpu_s']:.2f}x, "
              f"process {a['process_s'] / b['process_s']:.2f}x")


if __name__ == "__main__":
    main()
