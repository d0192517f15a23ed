"""Do two eviction policies make the same choices? For a change meant to be
faster only: every admit (how many keys it let in) and every evict (which
keys, in order) of each policy is folded into one hash per run, through the
real CPU manager, on bench_manager's stream and on generated workloads from
policy_workloads, at two capacities each. Prints SAME or DIFF per run.

    # the committed hubchain as a reference module, then the working tree's
    git show HEAD:src/kvoffload/policies/hubchain.py > /tmp/ref/hubchain_ref.py
    PYTHONPATH=src:/tmp/ref .venv/bin/python benchmarks/same_choices.py hubchain_ref:HubChainPolicy hubchain
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_manager as bm  # noqa: E402
import policy_workloads as pw  # noqa: E402

from kvoffload.abstractions import LookupResult, ReqContext  # noqa: E402
from kvoffload.policies import POLICIES, get_policy_class  # noqa: E402
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("policies", nargs=2, help="two policy names (registered, or module:Class)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    digest = [hashlib.sha256()]
    tags = [traced(p, digest) for p in args.policies]
    differ = 0
    for name, requests in workloads(args.seed):
        unique = len({k for r in requests for k in r})
        for cap in (max(16, unique // 100), max(16, unique // 20)):  # 1% and 5% of its distinct blocks
            got = []
            for tag in tags:
                digest[0] = hashlib.sha256()
                r = bm.run(CPUOffloadingManager(cap, tag), ReqContext, LookupResult.HIT, requests, 16, 4, False)
                got.append((r["hit_blocks"], r["evicted_blocks"], digest[0].hexdigest()[:12]))
            same = got[0] == got[1]
            differ += not same
            print(f"{name:14s} capacity {cap:6d}  {'SAME' if same else 'DIFF'}  "
                  + "  ".join(f"hits {h} evicted {e} choices {d}" for h, e, d in got), flush=True)
    print("same choices everywhere" if not differ else f"{differ} runs differ")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
