"""GPU check of the CPU tier worker: store and load random blocks of a
realistic KV layout between a CUDA device and the pinned host pool, check
every byte, and report bandwidth as a ratio of a plain pinned `copy_` of
the same bytes measured in the same run.

Layout (defaults): 32 layers, each a (num_blocks, 2, 16, 8, 128) bf16
tensor (64 KiB pages: K and V, 16 tokens, 8 KV heads of 128), one GPU
block per chunk, so a chunk is 2 MiB. Random GPU blocks go to random pool
slots (nothing merges: the worker's worst case), in jobs of 32 chunks.

Per round, each measured between two reference copies (the ratio is taken
against their mean, so the machine's swings cancel; medians of rounds):
- store: the worker copies the blocks GPU -> pool; reference: one
  `host.copy_(device, non_blocking=True)` of the same number of bytes into
  pinned memory;
- load: the worker copies them back pool -> other GPU blocks; reference:
  the other direction;
- both: a store of fresh blocks and a load at once (the worker's store and
  load streams); reference: both reference copies at once on two streams.
Every stored chunk is compared with the GPU pages it came from, and every
loaded block with the block it was stored from.

Needs only torch and numpy (and this package); one GPU; well under 3
minutes. On a machine without CUDA it prints one line and exits 0.

    python benchmarks/gpu_check.py                     # defaults: 32 layers, 2 MiB chunks, 1 GiB per measurement
    python benchmarks/gpu_check.py --device cpu --gpu-blocks 64 --blocks 32 --layers 4   # dry run of this script on CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # run from a checkout

from kvoffload.abstractions import CPULoadStoreSpec, GPULoadStoreSpec  # noqa: E402
from kvoffload.config import OffloadingConfig  # noqa: E402
from kvoffload.kv_caches import make_kv_caches  # noqa: E402
from kvoffload.tiers.cpu.worker import CPUOffloadingWorker  # noqa: E402

MiB = 2**20


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--page-shape", type=int, nargs="+", default=[2, 16, 8, 128],
                   help="one layer's page per GPU block, bf16 elements (default K/V, 16 tokens, 8 heads, 128)")
    p.add_argument("--gpu-blocks", type=int, default=2048, help="GPU blocks per layer (and pool slots)")
    p.add_argument("--blocks", type=int, default=512, help="blocks moved per measurement")
    p.add_argument("--chunks-per-job", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of this script")
    return p.parse_args(argv)


class Check:
    def __init__(self, args):
        self.args, self.dev = args, torch.device(args.device)
        self.cuda = self.dev.type == "cuda"
        g = torch.Generator(device=self.dev).manual_seed(0)
        shape = (args.gpu_blocks, *args.page_shape)
        # random bytes, bf16-typed like an engine's cache (the worker sees byte views)
        self.layers = [torch.randint(-128, 128, (args.gpu_blocks, 2 * int(np.prod(args.page_shape))),
                                     dtype=torch.int8, device=self.dev, generator=g).view(torch.bfloat16).view(shape)
                       for _ in range(args.layers)]
        self.page = 2 * int(np.prod(args.page_shape))
        self.chunk = self.page * args.layers
        cfg = OffloadingConfig.from_dict({"groups": [args.page_shape[1]], "tokens_per_hash": args.page_shape[1]})
        self.worker = CPUOffloadingWorker(make_kv_caches(self.layers), cfg, args.gpu_blocks)
        self.pool = torch.from_numpy(self.worker.pool.array)  # (slots, slot bytes) uint8, pinned on CUDA
        n = args.blocks * self.chunk
        self.ref_dev = torch.randint(-128, 128, (n,), dtype=torch.int8, device=self.dev, generator=g)
        self.ref_host = torch.empty(n, dtype=torch.int8, pin_memory=self.cuda)
        self.ref_dev2 = torch.empty_like(self.ref_dev)
        self.ref_host2 = torch.randint(-128, 128, (n,), dtype=torch.int8).pin_memory() if self.cuda else \
            torch.randint(-128, 128, (n,), dtype=torch.int8)
        self.streams = (torch.cuda.Stream(self.dev), torch.cuda.Stream(self.dev)) if self.cuda else None
        self.rng = np.random.default_rng(1)
        self.job_id = 0
        self.checked = 0

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def draw(self, k):
        """k disjoint sets of `blocks` random GPU blocks and pool slots."""
        n = self.args.blocks
        b = self.rng.permutation(self.args.gpu_blocks)[: k * n]
        s = self.rng.permutation(self.args.gpu_blocks)[: k * n]
        return [(b[i * n:(i + 1) * n], s[i * n:(i + 1) * n]) for i in range(k)]

    def submit(self, direction, blocks, slots):
        per, ids = self.args.chunks_per_job, []
        for i in range(0, len(blocks), per):
            self.job_id += 1
            gpu, cpu = GPULoadStoreSpec(blocks[i:i + per]), CPULoadStoreSpec(slots[i:i + per])
            w = self.worker
            ok = w.submit_store(self.job_id, gpu, cpu) if direction == "store" else w.submit_load(self.job_id, cpu, gpu)
            assert ok, w.last_error
            ids.append(self.job_id)
        return ids

    def finish(self, ids):
        self.worker.wait(set(ids))
        results = self.worker.get_finished()
        bad = [r.job_id for r in results if not r.success]
        assert not bad, f"jobs failed: {bad}"

    def ref(self, direction):
        if direction == "store":
            self.ref_host.copy_(self.ref_dev, non_blocking=True)
        elif direction == "load":
            self.ref_dev2.copy_(self.ref_host2, non_blocking=True)
        else:  # both at once, on two streams
            if not self.cuda:
                self.ref("store"), self.ref("load")
                return
            for s, (dst, src) in zip(self.streams, ((self.ref_host, self.ref_dev), (self.ref_dev2, self.ref_host2))):
                with torch.cuda.stream(s):
                    dst.copy_(src, non_blocking=True)

    def timed(self, fn):
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    def check_stored(self, blocks, slots):
        """Every stored chunk holds its block's pages, layer after layer."""
        idx = torch.from_numpy(blocks).to(self.dev)
        want = torch.cat([t.view(torch.uint8).reshape(t.shape[0], -1)[idx] for t in self.layers], dim=1).cpu()
        got = self.pool[torch.from_numpy(slots), : self.chunk]
        if not torch.equal(want, got):
            rows = (want != got).any(dim=1).nonzero().flatten()[:5].tolist()
            raise AssertionError(f"stored chunks differ from their GPU pages (first bad: {rows})")
        self.checked += want.numel()

    def check_loaded(self, src_blocks, dst_blocks):
        a, b = torch.from_numpy(src_blocks).to(self.dev), torch.from_numpy(dst_blocks).to(self.dev)
        for t in self.layers:
            t = t.view(torch.uint8)  # random bytes hold NaNs: compare bytes, not bf16 values
            if not torch.equal(t[a], t[b]):
                raise AssertionError("loaded blocks differ from the blocks they were stored from")
            self.checked += t[a].numel() * t.element_size()

    def run(self):
        args, nbytes = self.args, self.args.blocks * self.chunk
        ratios = {"store": [], "load": [], "both": []}
        gbps = {k: [] for k in ratios}
        ref_gbps = {k: [] for k in ratios}
        for r in range(args.rounds + 1):  # round 0 warms up
            (src, slots), (dst, _), (src2, slots2) = self.draw(3)

            def store():
                self.finish(self.submit("store", src, slots))

            def load():
                self.finish(self.submit("load", dst, slots))

            def both():
                self.finish(self.submit("store", src2, slots2) + self.submit("load", dst, slots))

            for name, fn, ref_bytes in (("store", store, nbytes), ("load", load, nbytes), ("both", both, 2 * nbytes)):
                before = self.timed(lambda: self.ref(name))
                t = self.timed(fn)
                after = self.timed(lambda: self.ref(name))
                if r:
                    ratios[name].append((before + after) / 2 / t)
                    gbps[name].append(ref_bytes / t / 1e9)
                    ref_gbps[name].append(ref_bytes / ((before + after) / 2) / 1e9)
                if name == "store":
                    self.check_stored(src, slots)
                elif name == "load":
                    self.check_loaded(src, dst)
                else:
                    self.check_stored(src2, slots2)
                    self.check_loaded(src, dst)
        return ratios, gbps, ref_gbps


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing to check")
        return 0
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    c = Check(args)
    name = torch.cuda.get_device_name(c.dev) if c.cuda else "CPU (dry run)"
    print(f"{name}: {args.layers} layers, {c.page // 1024} KiB pages, {c.chunk / MiB:g} MiB chunks, "
          f"{args.blocks} random blocks ({args.blocks * c.chunk / MiB:.0f} MiB) per measurement, "
          f"{args.chunks_per_job} chunks per job, pool pinned: {c.worker.pool.pinned}, setup {time.perf_counter() - t0:.1f} s")
    ratios, gbps, ref_gbps = c.run()
    c.worker.shutdown()
    print(f"median of {args.rounds} rounds; reference: a pinned copy_ of the same bytes, same round")
    print(f"{'':6} {'worker GB/s':>12} {'copy_ GB/s':>11} {'ratio':>6}")
    for k in ratios:
        print(f"{k:6} {statistics.median(gbps[k]):12.2f} {statistics.median(ref_gbps[k]):11.2f} "
              f"{statistics.median(ratios[k]):6.2f}")
    print(f"every byte checked: {c.checked / MiB:.0f} MiB compared, all equal; total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
