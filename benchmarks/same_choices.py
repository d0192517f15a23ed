"""Do eviction policies make the same choices as a reference? For a change
meant to leave choices alone (a speed-up, a refactor): every admit (how many
keys it let in) and every evict (which keys, in order) of each policy is
folded into one hash per run, through the real CPU manager, on
bench_manager's stream and on generated workloads from policy_workloads, at
two capacities each (1% and 5% of the distinct blocks).

Two ways to compare:

- two policies in one process (a registered name or module:Class each):

    PYTHONPATH=src .venv/bin/python benchmarks/same_choices.py lru my_module:MyLRU

- one tree against another, through a file: record each policy's runs with
  the reference tree's code (--save), then check the working tree's against
  it (--against). The reference's code is the src/ on PYTHONPATH; this
  script and the workloads come from benchmarks/ beside it.

    git worktree add "$REF" main && (cd "$REF" && python setup.py build_ext --inplace)
    PYTHONPATH=$REF/src .venv/bin/python benchmarks/same_choices.py --save choices.json
    PYTHONPATH=src .venv/bin/python benchmarks/same_choices.py --against choices.json

Prints SAME or DIFF per run; exits 1 if any run differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_manager as bm  # noqa: E402
import policy_workloads as pw  # noqa: E402

from kvoffload.abstractions import LookupResult, ReqContext  # noqa: E402
from kvoffload.policies import POLICIES, get_policy_class, policy_names  # noqa: E402
from kvoffload.tiers.cpu.manager import CPUOffloadingManager  # noqa: E402


def traced(name: str, digest: list) -> str:
    """Register a subclass of the policy that folds its choices into digest[0]."""
    base = get_policy_class(name)

    class Traced(base):
        def admit(self, keys, free, ctx, can_evict):
            n = super().admit(keys, free, ctx, can_evict)
            digest[0].update(b"A%d" % n)
            return n

        def evict(self, n, can_evict):
            victims = super().evict(n, can_evict)
            digest[0].update(b"E" + (b"".join(victims) if victims is not None else b"-"))
            return victims

    tag = "traced-" + name.replace(":", "-").replace(".", "-").lower()
    POLICIES.register(tag, Traced)
    return tag


def workloads(seed: int) -> list[tuple[str, list[list[bytes]]]]:
    flat, offsets, hashes = bm.make_stream(100_000, seed)
    key_of = [h.tobytes() + bm.GROUP for h in hashes]
    rows = [("bench_manager", [[key_of[b] for b in flat[offsets[i]: offsets[i + 1]]] for i in range(len(offsets) - 1)])]
    for name, make in (("convo", lambda: pw.convo(seed=seed + 101, sessions=1500)),
                       ("multisys", lambda: pw.multisys(seed=seed + 101, sessions=1500)),
                       ("tools", lambda: pw.tools(seed=seed + 97, sessions=600)),
                       ("oneshot", lambda: pw.oneshot(seed=seed + 98)),
                       ("scan", lambda: pw.scan(seed=seed + 99))):
        rows.append((name, [prompt + decode for prompt, decode in make()]))
    return rows


def runs(policies: list[str], seed: int):
    """(workload, capacity, policy, (hits, evicted, choice hash)) for each run."""
    digest = [hashlib.sha256()]
    tags = {p: traced(p, digest) for p in policies}
    for name, requests in workloads(seed):
        unique = len({k for r in requests for k in r})
        for cap in (max(16, unique // 100), max(16, unique // 20)):
            for p in policies:
                digest[0] = hashlib.sha256()
                r = bm.run(CPUOffloadingManager(cap, tags[p]), ReqContext, LookupResult.HIT, requests, 16, 4, False)
                yield name, cap, p, [r["hit_blocks"], r["evicted_blocks"], digest[0].hexdigest()[:16]]


def show(name: str, cap: int, label: str, same: bool, got: list) -> None:
    print(f"{name:14s} capacity {cap:6d}  {label:10s} {'SAME' if same else 'DIFF'}  "
          + "  ".join(f"hits {h} evicted {e} choices {d}" for h, e, d in got), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("policies", nargs="*", help="two policy names (registered, or module:Class) to compare; "
                    "with --save: the policies to record (default: every registered one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", type=Path, help="record the runs of these policies to this JSON file")
    ap.add_argument("--against", type=Path, help="compare each policy recorded in this JSON file with the same name here")
    args = ap.parse_args()
    differ = 0
    if args.save:
        names = args.policies or policy_names()
        record = {"seed": args.seed, "runs": [[n, c, p, got] for n, c, p, got in runs(names, args.seed)]}
        args.save.write_text(json.dumps(record, indent=0) + "\n")
        print(f"recorded {len(record['runs'])} runs of {', '.join(names)} to {args.save}")
        return
    if args.against:
        record = json.loads(args.against.read_text())
        want = {(n, c, p): got for n, c, p, got in record["runs"]}
        names = list(dict.fromkeys(p for _, _, p in want))
        for name, cap, p, got in runs(names, record["seed"]):
            ref = want[(name, cap, p)]
            same = got == ref
            differ += not same
            show(name, cap, p, same, [ref, got])
    else:
        if len(args.policies) != 2:
            ap.error("name two policies, or use --save / --against")
        by_run: dict = {}
        for name, cap, p, got in runs(args.policies, args.seed):
            by_run.setdefault((name, cap), []).append(got)
            if len(by_run[(name, cap)]) == 2:
                same = by_run[(name, cap)][0] == by_run[(name, cap)][1]
                differ += not same
                show(name, cap, "", same, by_run[(name, cap)])
    print("same choices everywhere" if not differ else f"{differ} runs differ")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
